"""weft: overlapped multi-GPU kernels for PyTorch and any DLPack framework.

One process per GPU, started by torchrun, mpirun or weft-launch:

    import torch, weft
    comm = weft.init()                        # rendezvous with the other processes
    x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    y = weft.all_reduce(x)                    # queued on torch's current stream
    z = comm.empty((1 << 20,), "bf16")        # symmetric tensor: zero-copy input/output (DLPack)

Torch tensors in, torch tensors out when torch is the caller; other frameworks pass anything with
__dlpack__ and get symmetric tensors back (wrap them with their from_dlpack). On torch tensors every op is a
torch operator (torch.ops.weft.*: torch.compile traces it, CUDA graphs capture it) with autograd; ops given
out= run eagerly and are not differentiable, and so do the FP8 functions (scaled_mm, quantize_fp8).

A team on one GPU, for developing and testing multi-rank code without several GPUs (no launcher):

    team = weft.virtual_team(4)               # 4 ranks on this GPU, each with its own stream
    ys = team.run(lambda comm, x: weft.all_reduce(x, comm=comm), xs)   # xs[r]: rank r's input

Errors: everything weft raises is a WeftError (a RuntimeError): environment and GPU problems as WeftError
itself, bad arguments as WeftValueError / WeftTypeError, which are also ValueError / TypeError. Bad input is
refused with the reason before anything reaches the GPU.
"""
from __future__ import annotations

from . import _weft

__version__ = _weft.__version__

# The public names: these and each area module's __all__ (assembled below, after the areas are imported).
_RUNTIME_NAMES = ["init", "init_multi_node", "virtual_team", "Team", "Communicator", "MultiNodeTeam",
                  "register_torch_backend", "WeftError", "WeftValueError", "WeftTypeError", "__version__"]

# ---- the package's mutable state -------------------------------------------------------------------------
# It lives here, in the package module, and nowhere else: the area modules below read and write it as
# attributes of this module at call time (`import weft as _w` ... `_w._default`), never through a name bound
# at import (which would be a stale copy once init() or _torch_api() rebinds it). So
# mock.patch.object(weft, "_default", None) reaches every op, and weft._ops / weft._torch are the ones the
# ops use. Defined before the area modules are imported (they import this partly initialised module).
_default = None  # the default Communicator of the module-level ops (set by init)
# Every Communicator by id: torch operators name their communicator by this integer.
_communicators = {}
# weft._torch_ops once torch is imported (it makes the torch operators of the op table, weft._op_table), else
# None (set by _torch_api).
_ops = None
# torch's Tensor type, current-stream getters and empty, once the caller has imported torch (_torch_api).
_torch = None
# init() calls so far in this process (_secret_key: the n-th call of each rank reads the n-th secret).
_inits = 0
# The MultiNodeTeam of init_multi_node() (the torch backend's, on a job spanning nodes), else None.
_default_multi_node = None
# Whether weft's torch.distributed backend ("weft", weft._torch_backend) is registered (by _torch_api).
_torch_backend_registered = False

# ---- the areas ---------------------------------------------------------------------------------------------
from ._errors import WeftError, WeftTypeError, WeftValueError
from . import _attention, _collectives, _fp8, _moe, _tensor_parallel
from ._collectives import *  # noqa: F401,F403 (each area module's __all__)
from ._tensor_parallel import *  # noqa: F401,F403
from ._attention import *  # noqa: F401,F403
from ._moe import *  # noqa: F401,F403
from ._fp8 import *  # noqa: F401,F403
from ._runtime import Communicator, MultiNodeTeam, Team, init, init_multi_node, register_torch_backend, virtual_team
from . import _args, _runtime

__all__ = (_RUNTIME_NAMES + _collectives.__all__ + _tensor_parallel.__all__ + _attention.__all__ + _moe.__all__ +
           _fp8.__all__)

# torch's operators (weft._torch_ops) load once torch is imported; _args._torch_api() looks.
_torch_api = _args._torch_api
_torch_api()  # torch's operators, when torch came first
