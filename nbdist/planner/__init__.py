"""Plan training at cluster scale: a GPT-style model on thousands of GPUs, every term of its step visible.

    from nbdist import planner
    model = planner.gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    # or planner.llama(32, 4096, 32, 8, 14336): grouped-query attention, SwiGLU, untied output (Llama 3 8B)
    hw = planner.hardware("a100-80gb")        # "a100-40gb", "h100-sxm", "h200", "local" (this machine, measured)
    p = planner.predict(model, hw, gpus=1536, tp=8, pp=8, global_batch=2304, recompute="full")
    p.step_seconds, p.tflops_per_gpu, p.mfu, p.tokens_per_second, p.memory_per_gpu, p.fits, p.breakdown
    planner.search(model, hw, gpus=1536, global_batch=2304)     # the plans that fit, best first
    planner.predict(planner.llama(126, 16384, 128, 8, 53248, seq=131072), planner.hardware("h100-sxm"),
                    gpus=16384, tp=8, pp=16, cp=16, global_batch=128, zero=1)   # context parallelism: cp

Modules: catalog.py (hardware(name): the profiles of nbdist/cost/hardware.py), model.py (parameters, FLOPs,
activation bytes), shapes.py (a plan's shape, checked; which links its groups span), memory.py (bytes per GPU),
pipeline.py (nbdist's schedule simulator for the bubble), step.py (every term of the step's time), prediction.py
(predict, Prediction), frontier.py (search, the frontier), published.py (published runs the planner is checked
against: Megatron-LM Tables 1 and 2, Korthikanti et al. Tables 3 and 5, MT-NLG, Llama 3 Table 4), local.py ("local": the
running cluster's engines, measured). Plain Python in the notebook kernel: torch only in the local probe, on the
engines.
"""
from nbdist.cost.hardware import PROFILES, Hardware, Link
from nbdist.planner.catalog import hardware
from nbdist.planner.frontier import SearchResult, search
from nbdist.planner.model import GPT, gpt, llama
from nbdist.planner.prediction import Prediction, predict
from nbdist.planner.shapes import Shape, shape

__all__ = ["GPT", "PROFILES", "Hardware", "Link", "Prediction", "SearchResult", "Shape", "gpt", "hardware", "llama",
           "predict", "search", "shape"]
