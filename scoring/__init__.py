"""specreplay stage 2: replay stored shards through DFlash drafter checkpoints.

Never imports pipeline's target loading, generation or capture code: everything this
stage needs of the target is in the shards and the stored embedding / lm_head.
"""
