"""Healing: bring a converted (looped) model close to the original on a small budget.

Two stages, both reading the original model's hidden states from a teacher cache (teacher_cache.py):

1. **Layer-local distillation** (block reconstruction, as BRECQ and OmniQuant do for quantisation).
   Each shared layer k is trained, alone, to map the input of every depth d tied to it onto the
   original model's output at d: loss = mean over tied depths and tokens of
   ||block_k(x_d, slot_d) - y_d||^2 / ||y_d||^2 (per-token relative error: the next layer's norm
   removes each token's scale, so this is the error the rest of the network sees). Trained: the
   shared weights, the per-depth LoRAs and the norms. Inputs x_d are
   - ``parallel``: the original model's inputs at d (layers are independent), or
   - ``sequential``: the student's own inputs at d, produced by its already-healed earlier depths
     (GPTQ's order), so that each depth also learns to correct the error that reaches it. A shared
     layer is visited once per depth it serves; a depth it serves later still uses the teacher's
     input until it is reached, one it served earlier the student input computed then.
2. **End to end**: logit distillation (forward KL) from the original model's final state, plus
   ``hidden_weight`` x the mean per-depth relative hidden-state error (``hidden_loss``: squared, or its log1p
   per token, which bounds a far-off token's pull; every depth but those that end an
   intermediate loop, which are exits and may differ from the original's mid-network state), plus ``exit_weight`` x
   forward KL of every intermediate loop exit against the original model (``exit_target`` teacher) or against
   the student's own final output, detached (``final``: the agreement early exiting is judged by), so that the
   exit after loop 1 is trained for itself (early exiting reads it).

3. **Exit adapters** (models/exit_adapter.py), for models with more than one loop: the body, head and
   final norm frozen, an adapter per intermediate loop exit (by default ``affine``, a tuned lens) is
   trained so that the exit after loop i predicts the model's own final output (forward KL from the
   final loop's logits: self-distillation, as the paper's early-exit training does). The body stays
   the original's copy, which loop 2 needs as its input, and the exit still becomes usable.

**Healing for quantized serving** (``base_weights`` int4 or int8): before the first stage the shared weights are
rounded to the serving format by GPTQ (models/gptq.py) and frozen there; the stages then train the per-depth LoRA,
the norms and the biases around the rounding. `looplm quantize --weights FMT` (LoRA shared) of the result rounds
nothing new, so what the run measures is what is served. Run it on a healed model (``--local-share 0``) to
recover what rounding costs it.

The local stage reads the teacher from the cache, never runs it: a step costs the student alone. The
end-to-end and exit stages read rows by ``e2e_rows``: ``online`` (the default) takes the next rows of a seeded
pass over the whole training split and runs the original model on them, without gradients, so that every step
reads new text; ``cache`` draws them from the cached rows again (a step a fifth shorter, but a small cache read
many times over is memorised rather than generalised from). The embeddings, final norm and LM head stay the
original model's (frozen), so the original's logits are its final state through the student's own head.

Every evaluation scores the corpus's first held-out rows and, as text the run never heals on, the first windows
of each out-of-domain domain (data/ood.py), whose geometric mean against the original's is logged as
``ood_ratio``.

Budget: ``budget_minutes`` (wall time of cache, local and end-to-end work; evaluations not
counted) or ``tokens``, divided among the stages by plan.py. Run directory (run_dir.py)::

    run.json          settings and the step plan (checked on --resume)
    metrics.jsonl     one JSON object per logged step and evaluation (time, tokens, losses, perplexity)
    latest            name of the newest complete checkpoint (replaced atomically)
    checkpoints/NAME  looplm model dir + state.json (+ training.pt in the end-to-end stage: train/checkpoints.py)
    final/            the healed model (looplm dir: `looplm eval`, `serve` and `generate` read it)
    heal.png          held-out and out-of-domain perplexity against wall time and against tokens
    cache/            the teacher cache (unless --cache puts it elsewhere)

The modules, in the order a run uses them: config (settings and their checks), inputs (what the run reads, each step's
rows), plan (the budget as step counts), steps (the step math as plain functions), run (progress, clock, records,
checkpoints, evaluations), stages (local, end to end, exit adapters; the last two on train/step_loop.py's loop), recipe
(``heal``: all of it from top to bottom). What it shares with `looplm train`: the step loop, the checkpoints
(train/checkpoints.py) and the processes' gradients (train/distributed.py).
"""

from ..losses import relative_error, relative_error_log1p, token_errors
from .config import BASE_WEIGHTS, E2E_ROWS, EXIT_TARGETS, LOCAL_MODES, HealConfig
from .inputs import cached_rows, heldout_set, streamed_rows
from .recipe import heal, prepare
from .run import logged_by

__all__ = [
    "BASE_WEIGHTS",
    "E2E_ROWS",
    "EXIT_TARGETS",
    "HealConfig",
    "LOCAL_MODES",
    "cached_rows",
    "heal",
    "heldout_set",
    "logged_by",
    "prepare",
    "relative_error",
    "relative_error_log1p",
    "streamed_rows",
    "token_errors",
]
