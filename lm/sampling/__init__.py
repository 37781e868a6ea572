"""Sampling from a checkpoint: one prefill pass, then KV-cached decoding inside one jitted loop.

    from lm.config import SampleConfig   # the settings: max_new_tokens, temperature, top_k, top_p

    params, model_cfg, tok = load("runs/NAME")
    samples = generate(params, model_cfg, tok, ["ROMEO:", "JULIET:"], SampleConfig(max_new_tokens=100, temperature=0.8))
    for deltas in stream(params, model_cfg, tok, ["ROMEO:"], SampleConfig(max_new_tokens=100)):
        print(deltas[0].text, end="", flush=True)

    python sample.py [RUN_DIR] --prompt "ROMEO:" --num-samples 3 [--stream] [--stop STR]...

The package, one job a module:
    rules.py   how a row's next token is chosen: Greedy, Random (temperature, top-k, top-p), or each row's own
               settings as arrays (draw_rows); randomness
    loop.py    prefill, the cached step, the jitted decoding loop, generate and stream; the context window
    stops.py   stop strings: a row's tokens to its final text, Sample and Delta
    layout.py  the weights laid out for decoding (unscanned; on a CPU transposed or an untied head), kept per set
    slots.py   decoding over a fixed set of slots that rows enter and leave, each with its own settings (lm.serve)
    cli.py     the sample.py command line
"""

from lm.pretrained import load
from lm.sampling.cli import main
from lm.sampling.loop import bucket, check_fits, check_settings, generate, stream
from lm.sampling.rules import candidates
from lm.sampling.stops import Delta, Sample

__all__ = [
    "Delta",
    "Sample",
    "bucket",
    "candidates",
    "check_fits",
    "check_settings",
    "generate",
    "load",
    "main",
    "stream",
]
