"""Session 11: where the LoRA block's peak memory goes on the GPU (compile only, attention="cudnn", benchmark shape).

For each variant: XLA's temp/argument/output bytes (``compiled.memory_analysis()``), then the largest buffers live
at the peak from XLA's buffer assignment of the baseline (dumped with --xla_dump_to). Variants: ``DM_DTYPE`` None
(dm, the down projection's dx, in fp32) or bf16 (rounded once to the block's dtype).
Result (pass 3): dm in bf16 left the temp bytes unchanged (860.8 MiB), so the hook (``block.DM_DTYPE``) was removed
afterwards; setting it now does nothing. Run: ``python3 benchmarks/device/session11_mem.py $OUT/mem`` (header from JAXGRAD_COMMIT / JAXGRAD_DIRTY).
"""
import glob
import importlib
import os
import re
import sys

dump = sys.argv[1] if len(sys.argv) > 1 else "/tmp/xla_mem"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}/hlo --xla_dump_hlo_module_re=.*fwd_bwd.*"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxgrad.lora.bench import GROUP, PROJ  # noqa: E402
from jaxgrad.lora.config import LlamaConfig, LoraConfig  # noqa: E402

B = importlib.import_module("jaxgrad.lora.block")
print(f"# device {jax.devices()[0].device_kind}; jax {jax.__version__}; commit {os.environ.get('JAXGRAD_COMMIT')} "
      f"(uncommitted changes: {os.environ.get('JAXGRAD_DIRTY')}); command: python3 {' '.join(sys.argv)}")
batch, seq = 4, 2048
cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, rope_theta=1e4, max_position_embeddings=seq, vocab_size=256, rms_norm_eps=1e-5)
lcfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
shapes = {"q_proj": (2048, 2048), "k_proj": (1024, 2048), "v_proj": (1024, 2048), "o_proj": (2048, 2048),
          "gate_proj": (5632, 2048), "up_proj": (5632, 2048), "down_proj": (2048, 5632)}
sd = lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
params, lora = {"self_attn": {}, "mlp": {}}, {"self_attn": {}, "mlp": {}}
for p in PROJ:
    o, i = shapes[p]
    params[GROUP[p]][p] = {"weight": sd((o, i))}
    lora[GROUP[p]][p] = {"lora_A": sd((16, i)), "lora_B": sd((o, 16))}
for n in B.NORMS:
    params[n] = {"weight": sd((2048,))}
x = sd((batch, seq, 2048))


def fwd_bwd(params, lora, x, cot, grouped):
    y, pull = jax.vjp(lambda l, xx: B.block(params, l, xx, cfg, lcfg, attention="cudnn", group_projections=grouped),
                      lora, x)
    return y, *pull(cot)


for grouped in (False, True):
    for dm in (None, jnp.bfloat16):
        B.DM_DTYPE = dm
        c = jax.jit(fwd_bwd, static_argnums=4).lower(params, lora, x, x, grouped).compile()
        ma = c.memory_analysis()
        print(f"grouped={grouped} dm={'fp32' if dm is None else 'bf16'}: temp {ma.temp_size_in_bytes / 2**20:.1f} MiB, "
              f"arguments {ma.argument_size_in_bytes / 2**20:.1f} MiB, outputs {ma.output_size_in_bytes / 2**20:.1f} MiB")

# the baseline's largest live buffers at the peak (XLA's buffer assignment text)
for f in sorted(glob.glob(f"{dump}/hlo/*buffer-assignment.txt"))[:1]:
    text = open(f).read()
    m = re.search(r"(peak|Peak)[^\n]*\n((?:.*\n){0,60})", text)
    print(f"## {os.path.basename(f)}")
    print(m.group(0) if m else text[:6000])
