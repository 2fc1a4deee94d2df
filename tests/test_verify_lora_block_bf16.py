"""The whole LoRA block in bf16: the verifier's verdict can fail (issue #10).

What makes it possible: a rounded comparison's radius is the first-order running error bound E (linear in the
operands' errors), and a value whose sign is certain under rounding (a sum of positive exps) never flips against
zero. Judged instead on its multiplicative sum of |terms| M, which grows through RMSNorm and softmax to ~1e150, the
softmax denominator's ``den > 0`` would look uncertain at every row and its jumps (10^4-10^8 x ||g*|| per leaf) would
swamp every statistic: planted 1%, 3% and 10% errors would all pass.

Measured on this test-size block (hidden 24, seq 7, leaves of 32-336 entries, bf16 throughout, CPU, seed 0):
caught -- 10% in q_proj's lora_B, 3% in down_proj's lora_B, 3% in dx; not caught -- 3% in q_proj's lora_B, 1%
anywhere (the bf16 rounding of these small leaves is 0.7-2% of their norm). The correct block passes (seeds 0, 1, 2 and 4,
here and in tests/test_lora_block.py).
"""

import jax.numpy as jnp
import pytest

from jaxgrad.verify import check_vjp
from jaxgrad.verify.planted import with_backward_edit
from test_lora_block import _fns, _split_norms, make_block


def _planted(fn, where, scale):
    """fn whose backward returns q_proj's lora_B gradient (``where="q_proj"``) or dx (``"dx"``) (1 + scale) times
    too large."""
    def edit(dx, dl, dn):
        if where == "dx":
            return dx * (1 + scale), dl, dn
        q = dl["self_attn"]["q_proj"]
        return dx, {**dl, "self_attn": {**dl["self_attn"], "q_proj": {**q, "lora_B": q["lora_B"] * (1 + scale)}}}, dn

    return with_backward_edit(fn, edit)


@pytest.mark.slow  # ~45 s each on the 2-core CPU
@pytest.mark.parametrize(("where", "scale", "leaf"), [("q_proj", 0.1, "['self_attn']['q_proj']['lora_B']"),
                                                      ("dx", 0.03, "args[0]")], ids=["q_proj-B-10pct", "dx-3pct"])
def test_a_planted_gradient_error_in_the_bf16_block_is_caught(where, scale, leaf):
    params, lora, x = make_block(0, jnp.bfloat16)
    frozen, norms = _split_norms(params)
    fn, ref = _fns(frozen)
    report = check_vjp(_planted(fn, where, scale), ref, x, lora, norms, float64=False)
    assert not report.passed
    assert [lf.name for lf in report.leaves if not lf.passed] == [next(lf.name for lf in report.leaves
                                                                      if leaf in lf.name)]
