"""Everything that imports vLLM.  Only this sub-package may import vllm."""


def register() -> None:
    """Placeholder until the vLLM integration lands: nothing to register."""
