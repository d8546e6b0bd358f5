"""A simulated stage device (`conveyor worker --device sim`): every real part of a worker
(plans and their deltas, per-request state, block tables and slot mapping, the transport
between stages, token forwarding, timelines and metrics) with the forward pass replaced by
a sleep whose length comes from a timing model of the step over a hardware profile.

    profiles.py   hardware profiles: published peaks of H100 / H200 / A100, the fitted CPU
    timing.py     the timing model: FLOPs and bytes of a stage's step -> seconds
    tokens.py     deterministic sampled tokens (from the request's seed or prompt)
    runner.py     SimStageRunner: StageRunner's bookkeeping + the sleep
    transport.py  SimTransport: a small real tensor on the wire, the real bytes' time modeled
    measure.py    `python -m services.worker.sim.measure`: this machine's GF/s and GB/s
    calibrate.py  `python -m services.worker.sim.calibrate`: the model against real steps
    models/       config.json (+ a small tokenizer) of the models the sim ships

See docs/simulation.md.
"""

from pathlib import Path

MODELS_DIR = Path(__file__).with_name("models")
"""The shipped model directories: llama-2-70b, llama-3-8b, llama-3-70b, smollm2-135m."""
