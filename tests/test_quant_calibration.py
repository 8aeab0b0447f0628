"""GPTQ, AWQ, the saved AWQ/GPTQ directories and perplexity (minfer/quantization/{gptq,awq,calibrate,
formats,checkpoint}.py, minfer/quantize.py, minfer/eval.py), on random layers and a tiny random Llama.

- the packed layouts round-trip, and AWQ's is checked against a plain reading of its spec;
- GPTQ and AWQ each give a lower layer-output error than RTN on held-back rows (they can fail: the error is
  measured, not assumed);
- AWQ's folds leave the float model's logits unchanged;
- a saved directory loads (`LLM(model=DIR)`) to the same logits as the same codes loaded in memory;
- bad configs and incomplete checkpoints are clear errors;
- perplexity equals exp(mean NLL) computed from transformers' logits on the same windows.
"""

import json
import math

import pytest
import torch

from minfer.quantization import formats
from minfer.quantization.awq import fake_quantize, search_clip, search_scale
from minfer.quantization.gptq import gptq_quantize, hessian

VOCAB = 64


def _correlated_inputs(n, k, seed, outliers=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(n, k, generator=g) @ mix * torch.linspace(0.2, 3, k)
    if outliers:
        x[:, torch.randperm(k, generator=g)[:outliers]] *= 20  # the salient channels AWQ is about
    return x


def _rtn(w, G, zp_min=0):
    s, zp = formats.affine_params(w.reshape(w.shape[0], -1, G), zp_min=zp_min)
    return formats.dequantize_affine(formats.quantize_affine(w, s, zp, G), s, zp)


def _err(x, w_hat, w):
    return float(((x @ (w_hat - w).t()) ** 2).mean())


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_layout_round_trips(bits):
    w = torch.randn(48, 128)
    G = 64
    s, zp = formats.affine_params(w.reshape(48, -1, G), bits, zp_min=1)
    q = formats.quantize_affine(w, s, zp, G, bits)
    t = formats.pack_gptq(q, s, zp, bits)
    assert t["qweight"].shape == (128 * bits // 32, 48) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (128 // G, 48 * bits // 32) and t["scales"].dtype == torch.float16
    q2, s2, zp2, perm = formats.unpack_gptq(t, bits)
    assert torch.equal(q2, q) and torch.equal(zp2, zp) and torch.equal(s2, s) and perm is None
    # act-order: g_idx names each column's group; unpacking sorts the columns into contiguous groups
    g_idx = t["g_idx"].flip(0)
    q3, _, _, perm = formats.unpack_gptq(dict(t, g_idx=g_idx), bits)
    assert torch.equal(g_idx[perm].long(), torch.arange(128) // G) and torch.equal(q3, q[:, perm])
    with pytest.raises(ValueError, match="groups of equal size"):
        formats.unpack_gptq(dict(t, g_idx=torch.zeros(128, dtype=torch.int32)), bits)
    with pytest.raises(ValueError, match="zp - 1"):
        formats.pack_gptq(q, s, zp * 0, bits)


def test_awq_layout_matches_its_spec():
    w = torch.randn(40, 96)
    s, zp = formats.affine_params(w.reshape(40, -1, 32))
    q = formats.quantize_affine(w, s, zp, 32)
    t = formats.pack_awq(q, s, zp)
    assert t["qweight"].shape == (96, 5) and t["qzeros"].shape == (3, 5) and t["scales"].shape == (3, 40)
    # the spec read plainly: nibble i of qweight[k, c] is the code of output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]
    qw = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    for k in (0, 17, 95):
        for c in range(5):
            for i, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                assert int((qw[k, c] >> (4 * i)) & 15) == int(q[8 * c + col, k])
    q2, s2, zp2 = formats.unpack_awq(t)
    assert torch.equal(q2, q) and torch.equal(zp2, zp) and torch.equal(s2, s)


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("G", [32, 64])
def test_gptq_beats_rtn_on_held_back_rows(G, desc_act):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    x = _correlated_inputs(4096, 256, seed=1)
    train, held = x[:2048], x[2048:]
    q, s, zp, g_idx = gptq_quantize(w, hessian(train), G, desc_act=desc_act, return_g_idx=True)
    gi = g_idx.long()
    gptq = _err(held, (q.float() - zp[:, gi].float()) * s[:, gi], w)
    rtn = _err(held, _rtn(w, G, zp_min=1), w)
    assert gptq < 0.9 * rtn, (gptq, rtn)
    assert int(zp.min()) >= 1 and int(q.max()) <= 15
    if not desc_act:
        assert torch.equal(gi, torch.arange(256) // G)
    else:  # G columns per group; group 0 holds the G inputs with the largest H_jj
        assert torch.equal(torch.bincount(gi), torch.full((256 // G,), G))
        top = torch.argsort(torch.diag(hessian(train)), descending=True)[:G]
        assert bool((gi[top] == 0).all())


def test_gptq_with_identity_hessian_is_rtn():
    """With uncorrelated unit inputs there is no error to move (H^-1 diagonal): GPTQ rounds as RTN does."""
    w = torch.randn(16, 64)
    q, s, zp = gptq_quantize(w, torch.eye(64), 32, percdamp=0.0)
    assert torch.equal(formats.dequantize_affine(q, s, zp), _rtn(w, 32, zp_min=1))


def test_awq_scales_and_clipping_beat_rtn_on_held_back_rows():
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.05
    x = _correlated_inputs(2048, 256, seed=2, outliers=4)
    train, held = x[:1024], x[1024:]
    rtn = _err(held, fake_quantize(w, 64), w)
    s, losses = search_scale(train, w, 64)
    assert losses[0] == pytest.approx(_err(train, fake_quantize(w, 64), w), rel=1e-4)  # alpha 0: RTN itself
    scaled = fake_quantize(w * s, 64) / s
    awq = _err(held, scaled, w)
    clipped = fake_quantize(search_clip(train[:256] / s, w * s, 64), 64) / s
    assert awq < 0.8 * rtn, (awq, rtn)
    assert _err(held, clipped, w) <= awq * 1.02


# -- a tiny random Llama, saved as an HF directory ------------------------------------------------------
def _save_tiny(path, seed=0):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # salient input channels, as trained models have
            layer.input_layernorm.weight[:3] = 8.0
        model.model.embed_tokens.weight.mul_(20.0)
    model.save_pretrained(path)
    words = [f"w{i}" for i in range(VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[2]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=words[0], eos_token=words[1],
                                         unk_token=words[2]).save_pretrained(path)
    return path


def _text(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(_save_tiny(tmp_path_factory.mktemp("tiny") / "m"))


def _logits(model, ids):
    from minfer.attention import ForwardContext
    from minfer.attention.torch_ref import ContiguousBackend

    cfg = model.config
    cache = ContiguousBackend(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
                              torch.float32)
    with torch.no_grad():
        h = model(torch.tensor(ids), ForwardContext(cache, positions=torch.arange(len(ids)), start_pos=0))
        return model.compute_logits(h)


def test_awq_folds_leave_the_float_model_unchanged(tiny):
    from minfer.quantization.calibrate import fold_scales, load_for_calibration

    m = load_for_calibration(tiny).model
    ids = list(range(3, 40))
    before = _logits(m, ids)
    g = torch.Generator().manual_seed(0)
    cfg = m.config
    for layer in m.model.layers:
        fold_scales(layer, cfg, {k: torch.rand(n, generator=g) * 4 + 0.25 for k, n in (
            ("qkv", 64), ("o", cfg.num_key_value_heads * cfg.head_dim), ("gate_up", 64), ("down", 128))})
    after = _logits(m, ids)
    assert float((after - before).abs().max()) <= 1e-4 * float(before.abs().max())


@pytest.mark.parametrize("method", ["awq", "gptq", "gptq-act", "int4", "int8"])
def test_saved_directory_round_trips(tiny, tmp_path, method, monkeypatch):
    from minfer import LLM
    from minfer.model.layers import UnquantizedLinearMethod
    from minfer.model.loader import load_model
    from minfer.quantization import calibrate as cal
    from minfer.quantization.checkpoint import PrequantizedLinearMethod
    from minfer.quantize import quantize_model

    captured = {}
    real = cal.calibrate

    def spy(*a, **k):
        captured["qw"] = real(*a, **k)
        return captured["qw"]

    monkeypatch.setattr("minfer.quantize.calibrate", spy)
    act = method == "gptq-act"
    summary = quantize_model(tiny, "gptq" if act else method, 32, tmp_path / method, n_samples=8, seq_len=64,
                             use_tqdm=False, calib_text=_text(4000), **({"desc_act": True} if act else {}))
    cfgj = json.loads((tmp_path / method / "config.json").read_text())
    assert cfgj["quantization_config"]["quant_method"] == ("awq" if method == "awq" else "gptq")
    assert cfgj["quantization_config"].get("desc_act", False) is act
    if method == "awq":
        assert len(summary["awq_losses"]) == 2 and len(summary["awq_losses"][0]["qkv"]) == 20

    llm = LLM(model=str(tmp_path / method), max_model_len=128, seed=0)
    model = llm.llm_engine.worker.model
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.quantized and layer.layout == ("awq" if method == "awq" else "gptq")
    ids = list(range(3, 40))
    loaded = _logits(model, ids)

    # in memory: the same codes, with no file, through the same method
    if method == "int8":
        from minfer.quantize import quantize_int8_weights
        qw = quantize_int8_weights(cal.load_for_calibration(tiny).model)
    else:
        qw = captured["qw"]

    def tensors():
        for name, t in qw.float_state.items():
            yield name, t
        for name, (q, s, zp) in qw.linears.items():
            s = s.half().float()  # what the file keeps
            perm = None
            if name in qw.g_idx:  # act-order: the columns sorted by group (its own argsort, not unpack_gptq's)
                perm = torch.argsort(qw.g_idx[name].long(), stable=True)
                q = q[:, perm]
            if qw.bits == 8:
                codes, scale = formats.to_minfer_int8(q, s, zp)
                codes.prequant = ("int8", scale, None, None)
            else:
                codes, sc, z = formats.to_minfer_int4(q, s, zp)
                codes.prequant = ("int4", sc, z, perm)
            yield f"{name}.weight", codes

    monkeypatch.setattr("minfer.model.loader.unpack_checkpoint", lambda named, qcfg, source: tensors())
    mem = load_model(str(tmp_path / method)).model
    assert torch.equal(_logits(mem, ids), loaded)
    assert isinstance(mem.model.layers[0].mlp.down_proj.method, PrequantizedLinearMethod)

    # and the quantized model is close to the float one (a sanity bound, not the round trip)
    ref = _logits(load_model(tiny, dtype="float32", linear_method=UnquantizedLinearMethod()).model, ids)
    assert float((loaded - ref).abs().max()) < 0.5 * float(ref.abs().max())
    if act:
        # the g_idx is really act-order, and the loaded model reads its inputs in that order: without the
        # gather it would compute something else
        gi = qw.g_idx["model.layers.0.mlp.down_proj"].long()
        assert not torch.equal(gi, torch.arange(gi.numel()) // 32)
        assert all(getattr(m, "input_perm", None) is not None for m in model.model.layers[0].modules()
                   if getattr(m, "quantized", False))
        for m in model.modules():
            if getattr(m, "input_perm", None) is not None:
                m.input_perm = torch.arange(m.input_perm.numel())
        assert float((_logits(model, ids) - loaded).abs().max()) > 10 * float((loaded - ref).abs().max())


def test_saved_directory_errors(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    from minfer import LLM
    from minfer.quantize import quantize_model

    d = tmp_path / "g"
    quantize_model(tiny, "int4", 32, d, use_tqdm=False, calib_text=_text(100))
    with pytest.raises(ValueError, match="cannot re-quantize"):
        LLM(model=str(d), quantization="int8")
    with pytest.raises(ValueError, match="unknown key"):
        LLM(model=str(d), quantization="gptq", quantization_config={"group_size": 64})
    with pytest.raises(ValueError, match="loads a calibrated directory"):
        LLM(model=tiny, quantization="awq")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.scales"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj .* lacks \['scales'\]"):
        LLM(model=str(d))
    cfg = json.loads((d / "config.json").read_text())
    for bad, match in (({"quant_method": "fp8"}, "not one minfer reads"),
                       ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits=3"),
                       ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": "yes"}, "desc_act"),
                       ({"quant_method": "awq", "bits": 4, "group_size": 48}, "group_size=48")):
        (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config=bad)))
        with pytest.raises(ValueError, match=match):
            LLM(model=str(d))


def test_quantize_cli_errors(tiny, tmp_path, capsys):
    from minfer.quantize import main

    assert main(["--model", tiny, "--method", "int4", "--group-size", "48", "--out", str(tmp_path / "x")]) == 2
    assert "group_size must be one of" in capsys.readouterr().err
    assert main(["--model", tiny, "--method", "int4", "--group-size", "128", "--out", str(tmp_path / "x")]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_perplexity_equals_transformers_nll(tiny):
    import transformers

    from minfer import LLM
    from minfer.eval import perplexity, token_windows

    text = _text(700, seed=3)
    llm = LLM(model=tiny, max_model_len=128, seed=0)
    res = perplexity(llm, text, window=100, max_tokens=None, use_tqdm=False)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert res.num_windows == len(ids) // 100 >= 5 and res.num_tokens == res.num_windows * 99
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in token_windows(ids, 100):
            lp = torch.log_softmax(hf(torch.tensor([w])).logits[0].double(), -1)
            nll -= float(lp[torch.arange(99), torch.tensor(w[1:])].sum())
            n += 99
    assert res.nll == pytest.approx(nll / n, rel=1e-4)
    assert res.ppl == pytest.approx(math.exp(nll / n), rel=1e-3)
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(ids[:50], 100)
    with pytest.raises(ValueError, match="at least 2"):
        token_windows(ids, 1)


def test_greedy_agreement_counts_to_the_first_difference():
    from minfer.eval import greedy_agreement

    assert greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [])


def test_shipped_texts_are_disjoint_and_long_enough():
    from minfer.eval import load_text

    ev, cal = load_text("eval"), load_text("calib")
    assert len(ev) > 100_000 and len(cal) > 60_000
    assert ev[:2000] not in cal and cal[:2000] not in ev
    with pytest.raises(ValueError, match="unknown text"):
        load_text("train")


def test_quantize_cli_refuses_outputs_and_flags_it_cannot_use(tiny, tmp_path, capsys):
    import shutil

    from minfer.quantize import main

    def refused(*argv, match):
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert match in err and "usage:" in err, err

    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    before = (src / "model.safetensors").read_bytes()
    # out == the model (also spelled differently): refused, the source checkpoint untouched
    refused("--model", str(src), "--method", "int4", "--group-size", "32", "--out", str(src / ".." / "src"),
            match="is the model's own directory")
    assert (src / "model.safetensors").read_bytes() == before
    f = tmp_path / "file"
    f.write_text("x")
    refused("--model", str(src), "--method", "int4", "--group-size", "32", "--out", str(f), match="existing file")
    refused("--model", str(src), "--method", "int4", "--group-size", "32", "--out", "/proc/nope/q",
            match="--out /proc/nope/q: cannot create")
    # an out that already holds a checkpoint: refused unless --overwrite
    q = tmp_path / "q"
    assert main(["--model", str(src), "--method", "int4", "--group-size", "32", "--out", str(q)]) == 0
    refused("--model", str(src), "--method", "int4", "--group-size", "32", "--out", str(q),
            match="already holds a checkpoint")
    assert main(["--model", str(src), "--method", "int4", "--group-size", "32", "--out", str(q), "--overwrite"]) == 0
    # quantizing a quantized model: said so, and no empty directory left behind
    refused("--model", str(q), "--method", "int4", "--group-size", "32", "--out", str(tmp_path / "qq"),
            match="is already quantized")
    assert not (tmp_path / "qq").exists()
    refused("--model", str(src), "--method", "gptq", "--group-size", "32", "--seq-len", "2000", "--out",
            str(tmp_path / "g"), match="--seq-len 2000 is past the model's")
    assert not (tmp_path / "g").exists()
    for flag, value in (("--samples", "0"), ("--seq-len", "-1")):
        with pytest.raises(SystemExit) as e:
            main(["--model", str(src), "--method", "gptq", "--out", str(tmp_path / "g"), flag, value])
        assert e.value.code == 2 and f"{flag}: " in capsys.readouterr().err


def _nan(x):
    return torch.full_like(x, float("nan"))


def _one_inf(x):
    x = x.clone()
    x[0, 0] = float("inf")
    return x


def _shift(v):
    def f(g):
        g = g.clone()
        g[0] = v if v < 0 else int(g.max()) + v
        return g
    return f


# Each corruption of one linear's GPTQ tensors, and the error naming that tensor and what it should be.
GPTQ_CORRUPTIONS = [
    ("scales", lambda s: s[:-1], r"down_proj: scales has shape \(\d+, \d+\), not"),
    ("scales", _nan, r"down_proj: scales has \d+ non-finite"),
    ("scales", _one_inf, r"down_proj: scales has 1 non-finite"),
    ("g_idx", _shift(1), r"down_proj: g_idx holds groups 0\.\.\d+, outside 0\.\.\d+"),
    ("g_idx", _shift(-1), r"down_proj: g_idx holds groups -1\.\.\d+, outside"),
    ("g_idx", lambda g: g[:-1], r"down_proj: g_idx has shape \(\d+,\), not"),
    ("g_idx", lambda g: g.float(), r"down_proj: g_idx is torch.float32"),
    ("qweight", lambda q: q.float(), r"down_proj: qweight is torch.float32"),
]


def test_saved_gptq_tensors_are_checked_at_load(tiny, tmp_path):
    """A GPTQ directory with a short `scales`, a `g_idx` out of range / negative / too short, non-finite
    scales, or a float `qweight` / `g_idx` is refused at load, the error naming the tensor (unchecked, some
    read as act-order groups of unequal size and NaN scales loaded and generated token 0)."""
    from safetensors.torch import load_file, save_file

    from minfer import LLM
    from minfer.quantize import quantize_model

    d = tmp_path / "g"
    quantize_model(tiny, "int4", 32, d, use_tqdm=False, calib_text=_text(100))
    good = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    for leaf, corrupt, match in GPTQ_CORRUPTIONS:
        save_file({**good, f"{name}.{leaf}": corrupt(good[f"{name}.{leaf}"]).contiguous()},
                  str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            LLM(model=str(d), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    save_file(good, str(d / "model.safetensors"))  # the untouched tensors still load
    LLM(model=str(d), max_model_len=64, kv_cache_memory_bytes=1 << 20)


def test_saved_awq_with_non_finite_scales_is_refused(tiny, tmp_path):
    """An AWQ directory whose `scales` hold a NaN or an inf is refused at load, naming the tensor (unchecked,
    the layer's every output would be NaN and generation would emit token 0)."""
    from safetensors.torch import load_file, save_file

    from minfer import LLM
    from minfer.quantize import quantize_model

    d = tmp_path / "a"
    quantize_model(tiny, "awq", 32, d, use_tqdm=False, calib_text=_text(100), n_samples=2, seq_len=32)
    good = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.scales"
    for value in (float("nan"), float("inf")):
        bad = good[name].clone()
        bad.view(-1)[3] = value
        save_file({**good, name: bad}, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=r"o_proj\.scales has 1 non-finite"):
            LLM(model=str(d), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    save_file(good, str(d / "model.safetensors"))
    LLM(model=str(d), max_model_len=64, kv_cache_memory_bytes=1 << 20)
