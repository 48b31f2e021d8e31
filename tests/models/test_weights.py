"""The weights= choices: "float16" / "int8-dynamic", linear layers over FBGEMM's products
(models/kernels/quantized.py), and the engine on every choice (the block choices' own tests:
test_block_weights.py)."""

import random

import pytest
import torch
from torch import nn

from models.kernels import native
from models.kernels.quantized import Float16Linear, Int8Linear
from runtime import Engine

from ..conftest import random_prompt, run_threaded, tiny_model

needs_fbgemm = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                  reason="this torch build has no FBGEMM backend")
needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")


def linear(rows=96, cols=64, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(cols, rows, bias=bias)
    return layer.requires_grad_(False)


@needs_fbgemm
def test_float16_weights_compute_in_float32_with_rounded_weights():
    layer = linear()
    x = torch.randn(5, 64)
    rounded = x @ layer.weight.half().float().t() + layer.bias
    assert torch.allclose(Float16Linear(layer)(x), rounded, atol=1e-5)


@needs_fbgemm
def test_int8_dynamic_is_close_and_each_row_is_quantized_as_if_alone():
    layer = linear()
    x = torch.randn(7, 64)
    x[3] *= 1000  # a row with large activations must not coarsen the others
    together = Int8Linear(layer)(x)
    alone = torch.cat([Int8Linear(layer)(row[None]) for row in x])
    assert torch.equal(together, alone)
    exact = layer(x)
    error = (together - exact).abs().amax(-1) / exact.abs().amax(-1)
    assert error.max() < 0.05, error


@pytest.mark.parametrize("weights", [pytest.param("float16", marks=needs_fbgemm),
                                     pytest.param("int8-dynamic", marks=needs_fbgemm),
                                     pytest.param("int8", marks=needs_kernels), pytest.param("int4", marks=needs_kernels)])
def test_engine_streams_with_smaller_weights(weights):
    """Threaded requests with preemption: each greedy stream equals the same request run alone
    (an int8-dynamic row is quantized as if alone, see Int8Linear; a block product's row does not
    depend on its batch-mates)."""
    model = tiny_model("llama").to(torch.float32)
    rng = random.Random(3)
    prompts = [random_prompt(rng, 1, 30) for _ in range(12)]
    new_tokens = [rng.randint(1, 16) for _ in prompts]
    options = dict(weights=weights, max_batch_size=6, max_batch_tokens=32, block_size=4, num_kv_blocks=24)
    with Engine.from_pretrained(model, **options) as engine:
        assert not any(isinstance(m, nn.Linear) for m in engine.model.modules())
        together = run_threaded(engine, prompts, new_tokens, in_order=True)
        assert engine.stats()["preemptions"] > 0
        alone = [run_threaded(engine, [p], [n], threads=1)[0] for p, n in zip(prompts, new_tokens)]
    assert [together[i] for i in range(len(prompts))] == alone
    assert all(0 < len(tokens) <= n for tokens, n in zip(alone, new_tokens))


@pytest.mark.parametrize("weights, dtype, message", [
    ("int2", None, "unknown weights='int2'"),
    ("int4", torch.float64, "float32 activations"),
    ("float16", torch.float64, "float32 activations"),
])
def test_bad_weights_choice_is_refused_before_loading(weights, dtype, message, llama):
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(llama, weights=weights, dtype=dtype)


RESIDENT_AFTER_LOAD = """
import sys, psutil
import runtime
before = psutil.Process().memory_info().rss
engine = runtime.Engine.from_pretrained(sys.argv[1], weights=sys.argv[2], num_kv_blocks=16)
print(psutil.Process().memory_info().rss - before)
"""


@needs_kernels
def test_smaller_weights_take_less_resident_memory_right_after_loading(tmp_path):
    """What a user measures: the process's resident memory once from_pretrained returns, the
    float32 copies made while converting given back."""
    import subprocess
    import sys

    import transformers
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)  # 27M parameters: 108 MB in float32
    grown = {weights: int(subprocess.run([sys.executable, "-c", RESIDENT_AFTER_LOAD, str(tmp_path), weights],
                                         capture_output=True, text=True, check=True).stdout.split()[-1])
             for weights in ("float32", "int8", "int4")}
    # float32 grows by its 108 MB of weights and ~85 MB of the load's own (libraries, rotary tables);
    # the block weights keep 16-30 MB. Before the freed copies were given back: 0.96x float32.
    assert grown["int8"] < 0.7 * grown["float32"] and grown["int4"] < 0.7 * grown["float32"], grown
