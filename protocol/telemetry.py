"""Histogram bucket layouts that both sides export, so a dashboard can set a client's wait beside
the server's step latency bucket by bucket. Seconds; the RPC hop lives below a millisecond."""

LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
