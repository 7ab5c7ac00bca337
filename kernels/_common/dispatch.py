"""One backend choice for every public function: where a call runs, from the ``backend`` argument, where its
arrays live, and what each tier of the operation can do.

The rules, the same for attention, LLM.int8() and SnapKV:

- ``"cpu"`` takes NumPy arrays; device arrays with it are refused (``TypeError``), never copied silently.
- ``"auto"`` runs NumPy inputs on the CPU and device inputs on the GPU: on the CUDA C tier (``"cupy"``) when CuPy
  is installed and that tier can run these inputs, else on the Numba-CUDA tier.
- An explicit GPU tier that cannot run the inputs (a dtype, a head dim, a tile size it lacks) is refused with a
  ``ValueError`` that says what it takes, before anything is allocated; an operation without that tier is
  refused alike.
"""
from __future__ import annotations

from collections.abc import Callable

from . import gpu

BACKENDS = ("auto", "cpu", "numba-cuda", "cupy")
GPU_TIERS = ("numba-cuda", "cupy")


def choose_backend(operation: str, backend, arrays: dict, *, cupy_refuses: Callable[[], str | None] | None = None,
                   tiers: tuple[str, ...] = BACKENDS[1:]) -> str:
    """The tier a call of ``operation`` runs on: ``"cpu"``, ``"numba-cuda"`` or ``"cupy"``.

    Parameters
    ----------
    operation : str
        The public function's name, for the messages.
    backend : {"auto", "cpu", "numba-cuda", "cupy"}
        What the caller asked for.
    arrays : dict
        The inputs that decide where the call runs, by argument name.
    cupy_refuses : callable, optional
        Returns why the CUDA C tier cannot run these inputs ("float16 inputs with head dim 64 or 128; got
        float32, d=80"), or None when it can. Omitted: it runs every valid input.
    tiers : tuple of str
        The tiers the operation has (all three by default).

    Raises
    ------
    ValueError
        An unknown backend, a tier the operation lacks, or a GPU tier that cannot run these inputs.
    TypeError
        Device arrays with ``backend="cpu"``, or with an operation that has no GPU tier.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(map(repr, BACKENDS))}")
    if backend != "auto" and backend not in tiers:
        raise ValueError(f"{operation} has no {backend!r} tier; its backends: "
                         f"{', '.join(map(repr, ('auto',) + tiers))}")
    on_device = [name for name, x in arrays.items() if gpu.is_device_array(x)]
    if on_device and not any(t in tiers for t in GPU_TIERS):
        raise TypeError(f"{operation} runs on the CPU only; {', '.join(on_device)} "
                        f"{'is a device array' if len(on_device) == 1 else 'are device arrays'} (copy to the host)")
    if backend == "cpu" and on_device:
        raise TypeError(f"backend='cpu' takes NumPy arrays; {', '.join(on_device)} "
                        f"{'is a device array' if len(on_device) == 1 else 'are device arrays'} (use "
                        f"backend='auto' or 'numba-cuda', or copy to the host)")
    refusal = cupy_refuses() if cupy_refuses is not None and "cupy" in tiers else None
    if backend == "auto":
        if not on_device:
            return "cpu"
        if "cupy" in tiers and refusal is None and gpu.cupy_module() is not None:
            return "cupy"
        return "numba-cuda"
    if backend == "cupy" and refusal is not None:
        raise ValueError(f"backend='cupy' takes {refusal} (backend='numba-cuda' takes any)")
    return backend
