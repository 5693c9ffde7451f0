"""``falcon-vllm prepare-models``: convert offline GGUF models to fp32 HF directories (idempotent)."""

from falcon_vllm.models import DEFAULT_MODEL, OFFLINE_MODELS, model_path


def add_arguments(p):
    p.add_argument("models", nargs="*", default=[DEFAULT_MODEL], help=f"any of {', '.join(OFFLINE_MODELS)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def main(args):
    for name in args.models:
        print(model_path(name, args.dtype))
    return 0
