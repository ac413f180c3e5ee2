"""specreplay stage 1: run the target once and store what every drafter evaluation needs."""
