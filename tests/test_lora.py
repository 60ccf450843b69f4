"""LoRA against its reference, `peft` on `transformers`: logits (one device and a data x fsdp x model mesh),
gradients of A and B, merged weights, and adapter folders both ways, for every architecture meshlm reads;
the quantized base against the dequantized model and against the published NF4 definition (and
bitsandbytes' own quantizer); bad adapters refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.numpy import load_file, save_file

import meshlm
from meshlm import CheckpointError, ConfigError, api, cli, model, quant
from meshlm.config import LoraConfig
from meshlm.formats import adapters, hf
from meshlm.lora import adapter_table, delta, init_adapter
from tests import oracle
from tests.helpers.generation import greedy, hf_greedy
from tests.helpers.lora import ARCHS, TARGETS, VOCAB, peft_model

MESH = "data=2,fsdp=2,model=2"
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """A random transformers model of each architecture, saved once."""
    return {
        name: oracle.make_hf_model(tmp_path_factory.mktemp(name), seed=i, **config).path
        for i, (name, config) in enumerate(ARCHS.items())
    }


def forward(params: model.Params, cfg: meshlm.ModelConfig, tokens: np.ndarray = TOKENS) -> np.ndarray:
    """`model.forward`'s logits, compiled as one program: run eagerly, op by op, it compiled each operation of
    the model on its own, to the same function and float32 logits (within 2e-7 here); the gradients' test jits
    likewise (the ten tests 2 to 5 CPU s cheaper, in two runs of both versions)."""
    return np.asarray(jax.jit(model.forward, static_argnums=2)(params, jnp.asarray(tokens), cfg))


def peft_logits(m: PeftModel, tokens: np.ndarray = TOKENS) -> np.ndarray:
    with torch.no_grad():
        return m(torch.as_tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def saved_adapters(bases, tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """Each architecture's random PEFT adapter as `save_pretrained` writes it, with peft's logits. GPT-J's
    gives v a smaller rank through rank_pattern (padded with zeros in meshlm) and uses rsLoRA."""
    out = {}
    for arch, base in bases.items():
        extra = {"rank_pattern": {"v_proj": 2}, "use_rslora": True} if arch == "gptj" else {}
        m = peft_model(base, arch, **extra)
        folder = tmp_path_factory.mktemp(f"{arch}-adapter")
        m.save_pretrained(folder)
        out[arch] = (folder, peft_logits(m))
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_peft_adapter_logits_match_peft(arch, bases, saved_adapters):
    folder, want = saved_adapters[arch]
    lm = meshlm.load(bases[arch], adapter=folder)
    np.testing.assert_allclose(lm.logits(TOKENS), want, atol=1e-4, rtol=0)
    assert np.abs(want - oracle.HFModel(bases[arch], oracle.load_hf(bases[arch])).logits(TOKENS)).max() > 0.1


@pytest.mark.parametrize("arch", ["gptj", "neox"])
def test_peft_adapter_logits_match_peft_on_a_mesh(arch, bases, saved_adapters):
    folder, want = saved_adapters[arch]
    lm = meshlm.load(bases[arch], mesh=MESH, adapter=folder)
    a = lm.params["lora"]["q"]["a"]
    assert a.sharding.spec[1] == "fsdp" and a.sharding.spec[2] is None  # A split like its base's input, rank whole
    np.testing.assert_allclose(lm.logits(TOKENS), want, atol=1e-4, rtol=0)


def _peft_grads(m: PeftModel, tokens: np.ndarray) -> dict[str, np.ndarray]:
    t = torch.as_tensor(tokens)
    logits = m(t[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1))
    loss.backward()
    return {name.replace(".default", ""): p.grad.float().numpy() for name, p in m.named_parameters() if "lora_" in name}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_adapter_gradients_match_torch_autograd_through_peft(arch, tmp_path):
    """Against torch's float64 gradients, on a base drawn at the family's initializer_range (0.02): at
    the std 0.2 of the other tests GPT-Neo's unscaled attention scores are so large that torch's own
    fp32 gradients differ from its fp64 ones by 1e-5 (and transformers computes GPT-Neo's scores in
    fp32 even in a float64 model, so no reference is exact there)."""
    config = dict(ARCHS[arch])
    oracle.random_model(config.pop("model_type"), seed=5, std=0.02, **config).save_pretrained(tmp_path / "base")
    m = peft_model(tmp_path / "base", arch, seed=1)
    m.save_pretrained(tmp_path / "adapter")
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 10))
    want = _peft_grads(m.double(), tokens)

    lm = meshlm.load(tmp_path / "base", adapter=tmp_path / "adapter")
    base = {k: v for k, v in lm.params.items() if k != "lora"}
    loss = lambda lora: model.loss({**base, "lora": lora}, jnp.asarray(tokens), lm.config)[0]
    grads = adapters.host_adapter(jax.jit(jax.grad(loss))(lm.params["lora"]))  # one program, as in forward()

    # torch's gradients in meshlm's layout, through the same reader as the weights; a fused q/k/v module's
    # one A is shared by three meshlm adapters, so its gradient is the sum of theirs
    (tmp_path / "grads").mkdir()
    save_file(want, str(tmp_path / "grads" / adapters.WEIGHTS))
    (tmp_path / "grads" / adapters.CONFIG).write_text((tmp_path / "adapter" / adapters.CONFIG).read_text())
    reference = adapters.read_peft(tmp_path / "grads", lm.config)
    fused = arch in ("neox", "codegen")
    for role, parts in reference.items():
        ours_a = sum(grads[r]["a"] for r in "qkv") if fused and role in "qkv" else grads[role]["a"]
        for ours, ref in ((ours_a, parts["a"]), (grads[role]["b"], parts["b"])):
            rel = np.abs(ours - ref).max() / np.abs(ref).max()
            assert rel <= 1e-5, (role, rel)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_merge_equals_merge_and_unload(arch, bases, saved_adapters, tmp_path):
    folder, want_logits = saved_adapters[arch]
    merged = PeftModel.from_pretrained(oracle.load_hf(bases[arch]), folder).merge_and_unload()
    want = {k: v.detach().numpy() for k, v in merged.state_dict().items()}

    meshlm.merge(bases[arch], folder, tmp_path / "merged", to="hf")
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))
    merged_names = [n for n in got if n.removesuffix(".weight").endswith(tuple(TARGETS[arch]))]
    # CodeGen is written as GPT-J (the same math), whose q, k, v are not qkv_proj: the logits cover those
    modules = len(TARGETS[arch]) - (arch == "codegen")
    assert len(merged_names) == modules * 2
    for name in merged_names:  # (transformers renames a few others in memory, e.g. GPT-NeoX's head)
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(meshlm.load(tmp_path / "merged").logits(TOKENS), want_logits, atol=1e-4, rtol=0)


def _random_adapter(lm: api.LanguageModel, lora: LoraConfig, seed: int) -> model.Params:
    fresh = init_adapter(model.projections(lm.config), lora, jax.random.key(seed))
    return {
        role: {**parts, "b": 0.3 * jax.random.normal(jax.random.key(seed + 1), parts["b"].shape)}
        for role, parts in fresh.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gptj", "neox", "codegen"])
def test_meshlm_adapter_to_peft_folder_gives_meshlm_logits(arch, bases, tmp_path):
    """meshlm's adapters (separate q/k/v, some of them) through a PEFT folder, which peft loads as is."""
    lm = meshlm.load(bases[arch])
    lora = LoraConfig(rank=3, alpha=6, targets=("q", "v", "out", "fc_out"))
    adapter = _random_adapter(lm, lora, seed=3)
    ours = forward({**lm.params, "lora": adapter}, lm.config)
    hf_arch = hf.ARCHS[json.loads((bases[arch] / "config.json").read_text())["model_type"]]
    adapters.write_peft(tmp_path / "out", adapters.host_adapter(adapter), lm.config, hf_arch, base=str(bases[arch]))

    theirs = peft_logits(PeftModel.from_pretrained(oracle.load_hf(bases[arch]), tmp_path / "out").eval())
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # and back
    np.testing.assert_allclose(meshlm.load(bases[arch], adapter=tmp_path / "out").logits(TOKENS), ours, atol=1e-5)


@pytest.mark.slow
def test_fresh_adapter_changes_nothing(bases):
    lm = meshlm.load(bases["gptj"])
    lora = LoraConfig(targets=("q", "k", "v", "out", "fc_in", "fc_out"))
    fresh = init_adapter(model.projections(lm.config), lora, jax.random.key(0))
    for parts in fresh.values():  # A random (PEFT's bound 1 / sqrt(fan_in)), B zero
        fan_in = np.prod(parts["a"].shape[1:-1])
        assert 0.5 / np.sqrt(fan_in) < float(jnp.abs(parts["a"]).max()) <= 1 / np.sqrt(fan_in)
        assert not np.asarray(parts["b"]).any()
    base = forward(lm.params, lm.config)
    with_fresh = forward({**lm.params, "lora": fresh}, lm.config)
    np.testing.assert_allclose(with_fresh, base, atol=1e-5, rtol=0)  # another program: only rounding differs


@pytest.mark.parametrize(("ins", "outs"), [((4, 8), (32,)), ((32,), (4, 8))])  # as out; as q, k, v
def test_the_forward_pass_adds_what_merging_adds_to_the_weight(ins, outs):
    """One update for both: the adapter's term for an input x (jax, the forward pass) is x times the
    weight update merging adds (numpy, on the host)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((*ins, 3), np.float32), rng.standard_normal((3, *outs), np.float32)
    x, scale = rng.standard_normal((2, 5, *ins), np.float32), np.float32(0.5)
    weight = delta(a, b, scale)
    assert isinstance(weight, np.ndarray) and weight.shape == (*ins, *outs)
    got = delta(jnp.asarray(a), jnp.asarray(b), jnp.asarray(scale), jnp.asarray(x))
    np.testing.assert_allclose(got, np.tensordot(x, weight, len(ins)), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Bad adapters


def test_adapter_of_another_architecture_is_refused(bases, saved_adapters):
    with pytest.raises(CheckpointError, match="module .gpt_neox.* is not a projection of this 2-layer GPTJForCausalLM"):
        meshlm.load(bases["gptj"], adapter=saved_adapters["neox"][0])


def test_adapter_of_another_size_is_refused(bases, tmp_path):
    other = oracle.make_hf_model(tmp_path / "wide", **{**ARCHS["gptj"], "n_embd": 128}).path
    peft_model(other, "gptj").save_pretrained(tmp_path / "wide-adapter")
    with pytest.raises(CheckpointError, match="adapter does not match the base.*q_proj"):
        meshlm.load(bases["gptj"], adapter=tmp_path / "wide-adapter")


def test_dora_and_non_adapters_are_refused(bases, saved_adapters, tmp_path):
    folder = tmp_path / "dora"
    folder.mkdir()
    conf = json.loads((saved_adapters["gptj"][0] / adapters.CONFIG).read_text())
    (folder / adapters.CONFIG).write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        meshlm.load(bases["gptj"], adapter=folder)
    with pytest.raises(CheckpointError, match="not an adapter"):
        meshlm.load(bases["gptj"], adapter=bases["neo"])


def test_bad_lora_settings_are_one_line_errors(bases):
    cfg = meshlm.load(bases["gptj"]).config
    with pytest.raises(ConfigError, match="rank 65 exceeds projection 'q'"):
        adapter_table(model.projections(cfg), LoraConfig(rank=65, targets=("q",)))
    for bad, match in (
        ({"rank": 0}, "rank must be"),
        ({"targets": ["wq"]}, "target 'wq'"),
        ({"dropout": 1}, "dropout"),
    ):
        with pytest.raises(ConfigError, match=match):
            LoraConfig.from_dict(bad)


# ---------------------------------------------------------------------------------------------------
# The quantized base

# The NF4 values as published (QLoRA, appendix E; bitsandbytes' functional.py)
NF4_PUBLISHED = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip


def test_nf4_code_book_is_the_published_one():
    np.testing.assert_allclose(quant.nf4_code(), NF4_PUBLISHED, atol=2e-7, rtol=0)


def test_nf4_codes_and_block_scales_match_bitsandbytes():
    import bitsandbytes.functional as bnb

    w = np.random.default_rng(0).normal(size=(96, 256)).astype(np.float32)  # torch [out, in]
    packed, state = bnb.quantize_4bit(torch.as_tensor(w), blocksize=64, quant_type="nf4")
    np.testing.assert_allclose(state.code.numpy(), quant.nf4_code(), atol=1e-7)
    ours = quant.quantize(jnp.asarray(w.T[None]), "nf4", n_in=1)  # meshlm's [layers, in, out]
    np.testing.assert_allclose(np.asarray(ours.absmax[0]).T.reshape(-1), state.absmax.numpy(), rtol=1e-6)
    # bitsandbytes packs the flattened [out, in] weight two codes a byte, first in the high nibble
    theirs = packed.numpy().reshape(-1)
    codes = np.stack([theirs >> 4, theirs & 15], -1).reshape(96, 256)
    ours_codes = np.stack([np.asarray(ours.codes[0]) >> 4, np.asarray(ours.codes[0]) & 15], 2).reshape(256, 96).T
    assert (codes == ours_codes).mean() > 0.9999  # rounding ties aside
    np.testing.assert_allclose(
        np.asarray(jax.vmap(lambda q: q.dense(jnp.float32))(ours))[0].T,
        bnb.dequantize_4bit(packed, state).numpy(),
        atol=1e-6,
    )


def test_int8_is_per_output_channel_absmax():
    w = np.random.default_rng(1).normal(size=(1, 64, 4, 8)).astype(np.float32)
    q = quant.quantize(jnp.asarray(w), "int8", n_in=1)
    np.testing.assert_allclose(np.asarray(q.scale), np.abs(w).max(axis=1) / 127, rtol=1e-6)
    back = np.asarray(jax.vmap(lambda x: x.dense(jnp.float32))(q))
    assert np.abs(back - w).max() <= np.abs(w).max(axis=1, keepdims=True).max() / 254 + 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_forward_equals_the_dequantized_model(kind, bases):
    lm = meshlm.load(bases["neox"], quantize=kind)
    assert isinstance(lm.params["layers"]["attn"]["q"], quant.QuantizedWeight)
    dense = quant.dequantize_projections(lm.params, model.PROJECTION_PATHS)
    reference = forward(dense, lm.config)
    np.testing.assert_allclose(lm.logits(TOKENS), reference, atol=1e-4, rtol=0)
    exact = meshlm.load(bases["neox"]).logits(TOKENS)
    assert 0 < np.abs(reference - exact).max()  # the only error is the quantization's own


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_base_on_a_mesh_with_an_adapter(kind, tmp_path):
    """NF4 blocks run along the inputs, 64 at a time, so its mesh needs d_model and heads x d_head of 128."""
    base = oracle.make_hf_model(tmp_path / "base", **{**ARCHS["gptj"], "n_embd": 128, "n_head": 2}).path
    peft_model(base, "gptj").save_pretrained(tmp_path / "adapter")
    lm = meshlm.load(base, mesh=MESH, quantize=kind, adapter=tmp_path / "adapter")
    one = meshlm.load(base, quantize=kind, adapter=tmp_path / "adapter")
    codes = lm.params["layers"]["attn"]["q"].codes
    assert codes.sharding.spec[1] == "fsdp" and codes.sharding.spec[-2] == "model"  # inputs over fsdp, heads over model
    np.testing.assert_allclose(lm.logits(TOKENS), one.logits(TOKENS), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="save the full-precision model"):
        lm.save(tmp_path / "never")


@pytest.mark.slow
def test_nf4_needs_whole_blocks(tmp_path):
    cfg = meshlm.preset("gptj-demo").replace(d_model=48, n_head=4, d_ff=96, rotary_dim=4)
    with pytest.raises(ConfigError, match="nf4 quantizes blocks of 64"):
        meshlm.from_config(cfg, quantize="nf4")


# ---------------------------------------------------------------------------------------------------
# Running with an adapter, and the command line


@pytest.mark.slow
def test_greedy_generation_with_an_adapter_matches_peft(bases, saved_adapters):
    """Decoding with the KV cache runs the adapter too: token for token what peft's model generates."""
    folder, _ = saved_adapters["neo"]
    lm = meshlm.load(bases["neo"], adapter=folder)
    m = oracle.HFModel(bases["neo"], PeftModel.from_pretrained(oracle.load_hf(bases["neo"]), folder).eval())
    prompts = [[5, 17, 99, 3], [42, 7, 7, 130, 2, 9]]
    got = lm.generate_tokens(prompts, greedy(10))
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.tokens == hf_greedy(m, prompt, 10)[0]


def test_merge_and_export_on_the_command_line(bases, saved_adapters, tmp_path):
    folder, want = saved_adapters["codegen"]
    assert cli.main(["merge", str(bases["codegen"]), str(folder), str(tmp_path / "merged")]) == 0
    np.testing.assert_allclose(meshlm.load(tmp_path / "merged").logits(TOKENS), want, atol=1e-4, rtol=0)
    # nothing is overwritten; a base that is not a model is one line
    assert cli.main(["merge", str(bases["codegen"]), str(folder), str(tmp_path / "merged")]) == 1
    assert cli.main(["merge", str(folder), str(folder), str(tmp_path / "other")]) == 1
    assert cli.main(["export-adapter", str(bases["codegen"]), str(tmp_path / "x")]) == 1


@pytest.mark.slow
def test_a_trained_adapter_exported_for_peft_gives_meshlm_logits(bases, tmp_path):
    """`meshlm train` with a lora section on a transformers base, `meshlm export-adapter`, then peft."""
    from meshlm import train
    from tests.helpers.training import tiny_config, write_dataset

    rows = np.random.default_rng(3).integers(0, VOCAB, (8, 17))
    data = write_dataset(tmp_path / "data", rows, rows)
    lora = {"rank": 2, "alpha": 4.0, "targets": ["q", "v", "out", "fc_out"]}
    cfg = tiny_config(data, tmp_path / "run", model=meshlm.load(bases["neox"]).config, lora=lora,
                      init_from=str(bases["neox"]), total_steps=3)  # fmt: skip
    result = train.train(cfg, progress=False)
    assert cli.main(["export-adapter", str(tmp_path / "run"), str(tmp_path / "peft")]) == 0
    theirs = peft_logits(PeftModel.from_pretrained(oracle.load_hf(bases["neox"]), tmp_path / "peft").eval())
    np.testing.assert_allclose(result.lm.logits(TOKENS), theirs, atol=1e-4, rtol=0)
    assert np.abs(theirs - meshlm.load(bases["neox"]).logits(TOKENS)).max() > 1e-3  # the adapter trained
    assert json.loads((tmp_path / "peft" / adapters.CONFIG).read_text())["base_model_name_or_path"] == str(
        bases["neox"].absolute()
    )
