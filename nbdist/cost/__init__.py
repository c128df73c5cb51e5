"""The one source of prices and rules, plain data: collectives' steps, bytes and seconds (collectives.py), ZeRO's
memory rule (memory.py), what data parallelism communicates after backward (data_parallel.py), hardware profiles
(hardware.py), and how a waiting rank polls, so what it costs the ranks sharing its cores (waiting.py). The local
predictor (sharding/), the cluster-scale planner (planner/) and the labs all read it; they differ only in the
hardware they price on (an α-β fit measured here, or published figures)."""
