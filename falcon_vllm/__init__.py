"""falcon-vllm: Falcon speculative decoding (semi-autoregressive drafter + decoding tree) for vLLM.

``register()`` is the ``vllm.general_plugins`` entry point.  It is cheap and idempotent; the
vLLM-specific code lives in :mod:`falcon_vllm.vllm` and is only imported when vLLM loads plugins.
The rest of the package (tree, drafter, verification, reference engine, training) needs no vLLM.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point (runs in every vLLM process)."""
    from falcon_vllm.vllm import register as _register

    _register()
