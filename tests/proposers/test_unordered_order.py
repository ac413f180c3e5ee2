"""llama-server's ngram-cache breaks ties between counts in the iteration order of libstdc++'s
`std::unordered_map<int32_t, int32_t>` (proposers/ngram/unordered.py): that order against the real
libstdc++, a C++ program compiled here with g++ (the compiler the llama-server build uses), for
maps growing one insert at a time through several rehashes, and for their copies."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from proposers.ngram.unordered import UnorderedCounts

PROGRAM = r"""
#include <cstdint>
#include <cstdio>
#include <unordered_map>
int main() {
    int n;
    while (std::scanf("%d", &n) == 1) {
        std::unordered_map<int32_t, int32_t> counts;
        for (int i = 0; i < n; ++i) {
            int token;
            std::scanf("%d", &token);
            auto it = counts.find(token);
            if (it == counts.end()) counts.emplace(token, 1); else it->second++;
        }
        const std::unordered_map<int32_t, int32_t> copy = counts;  // ngram-cache iterates copies
        for (const auto & kv : copy) std::printf("%d:%d ", kv.first, kv.second);
        std::printf("\n");
    }
}
"""


@pytest.fixture(scope="module")
def libstdcxx(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.fail("g++ is missing: install it (Debian: apt-get install g++), as the llama-server build needs")
    tmp = tmp_path_factory.mktemp("unordered")
    (tmp / "order.cpp").write_text(PROGRAM)
    subprocess.run([compiler, "-O1", "-std=c++17", "-o", str(tmp / "order"), str(tmp / "order.cpp")], check=True)
    return str(tmp / "order")


def sequences() -> list[list[int]]:
    rng = random.Random(0)
    cases = [[5, 3, 5, 18, 31, 44], list(range(40)), list(range(40, 0, -1))]
    for vocab, length in ((3, 50), (20, 200), (300, 400), (5000, 3000), (49152, 6000)):
        cases += [[rng.randrange(vocab) for _ in range(length)] for _ in range(4)]
    return cases


def test_the_iteration_order_is_libstdcxx(libstdcxx):
    cases = sequences()
    stdin = "".join(f"{len(c)} {' '.join(map(str, c))}\n" for c in cases)
    lines = subprocess.run([libstdcxx], input=stdin, capture_output=True, text=True, check=True).stdout.splitlines()
    differ_from_insertion = 0
    for case, line in zip(cases, lines, strict=True):
        counts = UnorderedCounts()
        for token in case:
            counts.add(token)
        real = [tuple(map(int, item.split(":"))) for item in line.split()]
        assert list(counts.items()) == real, case[:10]
        differ_from_insertion += list(counts.counts.items()) != real  # the plausible wrong order
    assert differ_from_insertion >= len(cases) - 2, differ_from_insertion
