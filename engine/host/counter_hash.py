"""The counter hash's constants, defined once for its three implementations: torch
(`engine/sampling/rng.py`), numpy (`engine/host/draw_uniforms.py`) and Triton
(`engine/sampling/kernels/hash_rng.py`); `tests/test_rng.py` checks they agree bit for bit.

Every multiplier is odd and below 2**31, so a 32-bit word times one stays below 2**63 in an
int64 lane: the first is the "lowbias32" integer hash's, the second MurmurHash2's. ROUND is
added after each absorbed word so that an all-zero input does not stay at the fixed point 0.
"""
MASK32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x5BD1E995
ROUND = 0x9E3779B9
INV_2_32 = 2.0**-32

# Streams: which draw of a row a uniform belongs to.
TARGET = 0  # the row's own draw (sampling, strict verification)
ACCEPT = 1  # acceptance test of rejection-mode verification
RESIDUAL = 2  # draw from the residual distribution after a rejection
DRAFT = 3  # draft heads proposing tokens

INVERSE_CDF_COUNTER = 0xFFFFFFFF  # counter of the plain draw's uniform; never a token id
