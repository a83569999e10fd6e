"""Tests of the Python package that need no GPU (they run in CI): import, environment errors, and the
argument checks every op makes before anything reaches the GPU. Tensors are faked with hand-made
DLPack capsules; the communicator with a stand-in that never touches CUDA."""
import ctypes
import os
import subprocess
import sys
import types
import typing
import unittest
from unittest import mock

import weft
from weft import _weft


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_DTYPE_CODES = {"bf16": (4, 16), "fp16": (2, 16), "fp32": (2, 32), "int32": (0, 32)}


class FakeTensor:
    """Anything with __dlpack__: device memory at a fake address, never dereferenced by these tests."""

    def __init__(self, shape, dtype="bf16", device_type=2, device_id=0, strides=None):
        self.shape, self.dtype = tuple(shape), dtype
        self._keep = []
        n = len(shape)
        shp = (ctypes.c_int64 * max(n, 1))(*shape)
        std = None if strides is None else (ctypes.c_int64 * max(n, 1))(*strides)
        code, bits = _DTYPE_CODES[dtype]
        self._m = _DLManagedTensor()
        t = self._m.dl_tensor
        t.data, t.device, t.ndim = 0x100000, _DLDevice(device_type, device_id), n
        t.dtype = _DLDataType(code, bits, 1)
        t.shape = ctypes.cast(shp, ctypes.POINTER(ctypes.c_int64))
        t.strides = None if std is None else ctypes.cast(std, ctypes.POINTER(ctypes.c_int64))
        self._keep += [shp, std]

    def __dlpack__(self, stream=None):
        return _PyCapsule_New(ctypes.addressof(self._m), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, 0)


class FakeNative:
    """Stands in for _weft.Comm: rank 0 of 4 on cuda:0. Any attempt to run an op fails the test."""

    rank, world_size, device, stream = 0, 4, 0, 0

    def empty(self, shape, dtype):
        return FakeTensor(shape, dtype)


class NoGpu(unittest.TestCase):
    def setUp(self):
        self.comm = weft.Communicator(FakeNative())
        # Reaching the C++ op means every check passed: record the call instead of running it.
        self.calls = []
        for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter", "gather",
                     "reduce", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
            p = mock.patch.object(_weft, name, lambda *a, _n=name: self.calls.append((_n, a[1:])))
            p.start()
            self.addCleanup(p.stop)

    def raises(self, exc, fragment, fn, *args, **kw):
        with self.assertRaises(exc) as cm:
            fn(*args, **kw)
        self.assertIn(fragment, str(cm.exception))

    def test_module_imports(self):
        self.assertTrue(hasattr(weft, "all_reduce"))
        self.assertRegex(weft.__version__, r"^\d+\.\d+\.\d+$")

    def test_one_exception_hierarchy(self):
        self.assertTrue(issubclass(weft.WeftError, RuntimeError))
        self.assertTrue(issubclass(weft.WeftValueError, weft.WeftError))
        self.assertTrue(issubclass(weft.WeftValueError, ValueError))
        self.assertTrue(issubclass(weft.WeftTypeError, weft.WeftError))
        self.assertTrue(issubclass(weft.WeftTypeError, TypeError))

    def test_public_api_has_docstrings(self):
        for name in weft.__all__:
            obj = getattr(weft, name)
            if callable(obj):
                self.assertTrue(obj.__doc__, name)
        for name in ("empty", "barrier", "synchronize", "reserve_workspace", "all_reduce", "all_gather",
                     "reduce_scatter", "all_to_all", "all_gather_matmul", "matmul_reduce_scatter",
                     "matmul_all_reduce"):
            self.assertTrue(getattr(weft.Communicator, name).__doc__, name)

    def test_init_without_launcher_environment(self):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") and not k.startswith("OMPI_")}
        with mock.patch.dict(os.environ, env, clear=True):
            self.raises(weft.WeftError, "torchrun", weft.init)

    def test_init_without_a_driver_says_so(self):
        try:
            ctypes.CDLL("libcuda.so.1")
            self.skipTest("an NVIDIA driver is installed here")
        except OSError:
            pass
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        with mock.patch.dict(os.environ, env):
            self.raises(weft.WeftError, "no NVIDIA driver", weft.init)

    def test_virtual_team_arguments(self):
        self.raises(weft.WeftValueError, "world must be an int >= 2", weft.virtual_team, 1)
        self.raises(weft.WeftValueError, "world must be an int >= 2", weft.virtual_team, "4")

    def test_virtual_team_without_a_driver_says_so(self):
        try:
            ctypes.CDLL("libcuda.so.1")
            self.skipTest("an NVIDIA driver is installed here")
        except OSError:
            pass
        with mock.patch.dict(os.environ, {}):
            self.raises(weft.WeftError, "no NVIDIA driver", weft.virtual_team, 2)
            self.assertEqual(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "32")

    def test_job_secret_through_torchs_store(self):
        """Under torchrun, rank 0's random secret reaches every rank through torch's store, a new one per
        init(); WEFT_JOB_SECRET, when set, is used instead (init passes none of its own)."""
        class Store(dict):
            def set(self, k, v):
                self[k] = v.encode()

            def get(self, k):
                return self[k]

        store = Store()
        key = weft._runtime._secret_key()
        first = weft._runtime._shared_secret(store, 0, key)
        self.assertGreaterEqual(len(first), 32)
        self.assertEqual([weft._runtime._shared_secret(store, r, key) for r in (1, 2, 3)], [first] * 3)
        self.assertNotEqual(weft._runtime._secret_key(), key)

        class Dist:  # torch.distributed before init_process_group, under torchrun's agent store
            class distributed_c10d:
                pass

            made = []

            @staticmethod
            def is_available():
                return True

            @staticmethod
            def is_initialized():
                return False

            @classmethod
            def TCPStore(cls, addr, port, is_master, timeout):
                cls.made.append((addr, port, is_master))
                return store

        torch = type("torch", (), {"distributed": Dist})
        agent = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        with mock.patch.dict(os.environ, agent):
            self.assertIs(weft._runtime._launcher_store(torch), store)
        self.assertEqual(Dist.made, [("127.0.0.1", 29500, False)])
        with mock.patch.dict(os.environ, {"TORCHELASTIC_USE_AGENT_STORE": "False"}):
            self.assertIsNone(weft._runtime._launcher_store(torch))

        calls = []
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "WEFT_JOB_SECRET": "0123456789abcdef0123"}
        with mock.patch.dict(os.environ, env), \
                mock.patch.object(_weft.Comm, "from_env", lambda t, s: calls.append(s) or FakeNative()):
            self.assertEqual(weft.init().job_secret_from, "WEFT_JOB_SECRET")
        self.assertEqual(calls, [""])

    def test_init_with_incomplete_environment(self):
        with mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": "2"}):
            self.raises(weft.WeftError, "LOCAL_RANK", weft.init)

    def test_init_multi_node_is_refused(self):
        env = {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
        with mock.patch.dict(os.environ, env):
            self.raises(weft.WeftError, "multi-node", weft.init)

    def test_init_multi_node_needs_the_nodes_meeting_address(self):
        env = {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("MASTER_ADDR", None)
            self.raises(weft.WeftError, "MASTER_ADDR", weft.init_multi_node)

    def test_ops_need_init(self):
        with mock.patch.object(weft, "_default", None):
            self.raises(RuntimeError, "weft.init()", weft.all_reduce, FakeTensor((8,)))

    def test_valid_calls_reach_the_kernels(self):
        x = FakeTensor((8, 6))
        self.comm.all_reduce(x)
        self.comm.all_gather(x, dim=1)
        self.comm.reduce_scatter(FakeTensor((8, 6)), dim=0)
        self.comm.all_to_all(x)
        self.assertEqual([c[0] for c in self.calls], ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
        _, ag = self.calls[1]
        self.assertEqual(ag[2:5], (8, 6, 1))  # rows, cols, dim-1 gather

    def test_rooted_collectives(self):
        """broadcast / scatter / gather / reduce reach the kernels with the part's element count and the root;
        a root outside the team, or a dim 0 that does not split, is refused; gather / reduce return None
        except at the root."""
        x = FakeTensor((8, 6))
        self.comm.broadcast(x, root=3)
        self.comm.scatter(x, root=1)
        self.assertIsNotNone(self.comm.gather(x))
        self.assertIsNone(self.comm.gather(x, root=2))
        self.assertIsNone(self.comm.reduce(x, root=1, op="max"))
        self.assertEqual([c[0] for c in self.calls], ["broadcast", "scatter", "gather", "gather", "reduce"])
        self.assertEqual(self.calls[0][1][2:5], (48, "bf16", 3))  # count, dtype, root
        self.assertEqual(self.calls[1][1][2:5], (12, "bf16", 1))  # a quarter of 48 elements
        self.assertEqual(self.calls[3][1][1], 0)  # no out away from the root
        self.assertEqual(self.calls[4][1][2:6], (48, "bf16", "max", 1))
        for fn in (self.comm.broadcast, self.comm.scatter, self.comm.gather, self.comm.reduce):
            self.raises(ValueError, "root must be a rank of the team", fn, x, root=4)
            self.raises(ValueError, "root must be a rank of the team", fn, x, root=-1)
        self.raises(ValueError, "splits dim 0 into 4 blocks", self.comm.scatter, FakeTensor((6, 2)))
        # all_to_all_v's counts are int64 torch tensors: other callers are told so.
        self.raises(TypeError, "takes torch tensors", weft.all_to_all_v, x, FakeTensor((4,)), 8, comm=self.comm)

    def test_subteam_lanes(self):
        """Communicator.subteam's lane: refused below 0 or not an int before anything reaches C++; a lane is its
        own sub-team (asked once per (size, stride, lane)), lane 0 of the whole team as before."""
        self.raises(ValueError, "lane must be 0 or more", self.comm.subteam, 4, 1, -1)
        self.raises(ValueError, "must be ints", self.comm.subteam, 4, 1, 1.0)
        asked = []

        class Native(FakeNative):
            def subteam(self, size, stride, lane):
                asked.append((size, stride, lane))
                return FakeNative()

        comm = weft.Communicator(Native())
        one, again = comm.subteam(4, 1, 1), comm.subteam(4, 1, 1)
        self.assertIs(one, again)
        self.assertIsNot(comm.subteam(4, 1, 2), one)
        self.assertEqual(asked, [(4, 1, 1), (4, 1, 2)])

    def test_process_groups_map_to_subteams(self):
        """A torch ProcessGroup's ranks map to weft's sub-team shape (size, stride): a 2 x 4 mesh's rows and
        columns on a team of 8; other rank sets are refused with the reason."""
        shape = weft._runtime._subteam_shape
        self.assertEqual(shape([4, 5, 6, 7], 8, 6), (4, 1))  # a mesh row: contiguous
        self.assertEqual(shape([1, 5], 8, 5), (2, 4))  # a mesh column: stride 4
        self.assertEqual(shape(range(8), 8, 3), (8, 1))  # the whole team
        self.assertEqual(shape([3], 8, 3), (1, 1))
        self.raises(ValueError, "not in the group", shape, [0, 1], 8, 5)
        self.raises(ValueError, "not evenly spaced", shape, [0, 1, 3], 8, 0)
        self.raises(ValueError, "do not tile", shape, [1, 2], 8, 1)  # pairs start at even ranks
        self.raises(ValueError, "do not tile", shape, [0, 1, 2], 8, 0)  # 3 does not divide 8

    def test_unsupported_dtype(self):
        self.raises(TypeError, "unsupported dtype", self.comm.all_reduce, FakeTensor((8,), "int32"))
        self.raises(TypeError, "unsupported dtype", self.comm.empty, (8,), "int8")

    def test_unsupported_op(self):
        self.raises(ValueError, "reduction op", self.comm.all_reduce, FakeTensor((8,)), op="prod")

    def test_host_memory_is_rejected(self):
        self.raises(weft.WeftValueError, "got CPU memory", self.comm.all_reduce, FakeTensor((8,), device_type=1))

    def test_wrong_device(self):
        self.raises(ValueError, "cuda:1", self.comm.all_reduce, FakeTensor((8,), device_id=1))

    def test_non_contiguous(self):
        self.raises(ValueError, "contiguous", self.comm.all_reduce, FakeTensor((4, 4), strides=(1, 4)))

    def test_not_a_tensor(self):
        self.raises(TypeError, "DLPack", self.comm.all_reduce, [1.0, 2.0])

    def test_out_shape_and_dtype(self):
        x = FakeTensor((8,))
        self.raises(ValueError, "shape", self.comm.all_reduce, x, out=FakeTensor((9,)))
        self.raises(TypeError, "dtype", self.comm.all_reduce, x, out=FakeTensor((8,), "fp32"))
        self.raises(ValueError, "shape", self.comm.all_gather, x, out=FakeTensor((8,)))

    def test_scatter_and_all_to_all_divisibility(self):
        self.raises(ValueError, "not divisible by the world size 4", self.comm.reduce_scatter, FakeTensor((6,)))
        self.raises(ValueError, "not divisible by the world size 4", self.comm.all_to_all, FakeTensor((6,)))

    def test_dim_out_of_range(self):
        self.raises(ValueError, "out of range", self.comm.all_gather, FakeTensor((4, 4)), dim=2)
        self.raises(ValueError, "0-d", self.comm.all_gather, FakeTensor(()))

    def test_negative_dim_counts_from_the_end(self):
        self.comm.all_gather(FakeTensor((2, 3, 4)), dim=-1)
        self.assertEqual(self.calls[-1][1][2:5], (6, 4, 1))

    def test_matmul_ops_reach_the_kernels(self):
        a, b_kn = FakeTensor((8, 16)), FakeTensor((16, 24))
        b_weight_t = FakeTensor((16, 24), strides=(1, 16))  # weight [24, 16] viewed as .t()
        self.comm.all_gather_matmul(a, b_weight_t)
        self.comm.matmul_reduce_scatter(a, b_kn)
        self.comm.matmul_all_reduce(a, b_kn, out=FakeTensor((8, 24)))
        (n0, ag), (n1, rs), (n2, ar) = self.calls
        self.assertEqual((n0, n1, n2), ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"))
        self.assertEqual(ag[4:8], (32, 24, 16, "nk"))  # M = 4 ranks x 8 rows, N, K, layout
        self.assertEqual(rs[3:7], (8, 24, 16, "kn"))

    def test_matmul_all_reduce_takes_any_m(self):
        # A decode batch of 7 rows on a team of 4: matmul_all_reduce takes it (reduce-scatter would not).
        self.comm.matmul_all_reduce(FakeTensor((7, 16)), FakeTensor((16, 24)), out=FakeTensor((7, 24)))
        name, args = self.calls[-1]
        self.assertEqual(name, "matmul_all_reduce")
        self.assertEqual(args[3:7], (7, 24, 16, "kn"))  # M, N, K, layout

    def test_matmul_ops_reject_bad_operands(self):
        a = FakeTensor((8, 16))
        self.raises(ValueError, "inner dimensions", self.comm.matmul_all_reduce, a, FakeTensor((8, 24)))
        self.raises(TypeError, "bf16", self.comm.matmul_all_reduce, FakeTensor((8, 16), "fp32"),
                    FakeTensor((16, 24), "fp32"))
        self.raises(ValueError, ".t() view", self.comm.matmul_all_reduce, a, FakeTensor((16, 24), strides=(2, 32)))
        self.raises(ValueError, "multiples of 8", self.comm.matmul_all_reduce, a, FakeTensor((16, 20)))
        self.raises(ValueError, "not divisible by the world size 4", self.comm.matmul_reduce_scatter,
                    FakeTensor((6, 16)), FakeTensor((16, 24)))
        self.raises(ValueError, "2-D", self.comm.matmul_all_reduce, FakeTensor((8, 16, 1)), FakeTensor((16, 24)))
        self.raises(ValueError, "shape", self.comm.all_gather_matmul, a, FakeTensor((16, 24)),
                    out=FakeTensor((8, 24)))
        # the first operand is called `a` in messages, as in the signature
        self.raises(ValueError, "a must be in CUDA device memory", self.comm.matmul_all_reduce,
                    FakeTensor((8, 16), device_type=1), FakeTensor((16, 24)))
        self.raises(ValueError, "a must be contiguous", self.comm.matmul_all_reduce,
                    FakeTensor((8, 16), strides=(1, 8)), FakeTensor((16, 24)))



class Fp8ScaleLayoutTest(unittest.TestCase):
    """How the FP8 GEMMs read A's block scales from a tensor's strides (weft._fp8._scale_a_layout)."""

    class Strided:  # the shape and strides of a 2-D tensor, no data
        def __init__(self, shape, strides):
            self.shape, self._strides = tuple(shape), tuple(strides)

        def dim(self):
            return len(self.shape)

        def stride(self, i=None):
            return self._strides if i is None else self._strides[i]

    def test_layouts(self):
        from weft import _fp8
        layout = lambda shape, strides: _fp8._scale_a_layout(self.Strided(shape, strides))  # noqa: E731
        self.assertEqual(layout((300, 9), (9, 1)), ("row", 9))  # contiguous
        self.assertEqual(layout((300, 9), (12, 1)), ("row", 12))  # rows with room between (a dispatch's rows)
        self.assertEqual(layout((300, 9), (1, 304)), ("m", 304))  # M-major, torch's 1 x 128 layout
        self.assertEqual(layout((300, 9), (1, 300)), ("m", 300))
        self.assertEqual(layout((1, 9), (1, 4)), ("m", 4))  # one row, M-major
        self.assertEqual(layout((1, 9), (9, 1)), ("row", 9))  # one row, contiguous
        self.assertEqual(layout((300, 1), (1, 1)), ("row", 1))  # one k-block: either layout reads as rows
        self.assertEqual(layout((300, 1), (1, 300)), ("row", 1))
        self.assertIsNone(layout((300, 9), (2, 600)))  # neither
        self.assertIsNone(layout((300, 9), (1, 299)))  # columns overlapping the next k-block's
        self.assertIsNone(layout((300,), (1,)))


class RingShardTest(unittest.TestCase):
    """Ring attention's sequence layout (the C++ plan through the module): zigzag parts, packed documents."""

    def test_zigzag_parts(self):
        self.assertEqual(weft.ring_shard_indices(2, 0, causal=True, seq_len=8), [0, 1, 6, 7])
        self.assertEqual(weft.ring_shard_indices(2, 1, causal=True, seq_len=8), [2, 3, 4, 5])
        self.assertEqual(weft.ring_shard_indices(2, 1, causal=False, seq_len=8), [4, 5, 6, 7])
        # Contiguous causal shards: rank r holds the r-th slice of each document.
        self.assertEqual(weft.ring_shard_indices(4, 1, causal=True, seq_len=10, contiguous=True), [3, 4, 5])
        self.assertEqual(weft.ring_shard_indices(2, 1, causal=True, cu_seqlens=[0, 5, 9], contiguous=True),
                         [3, 4, 7, 8])

    def test_ranks_partition_any_lengths(self):
        for world in (2, 3, 4, 8):
            for causal in (False, True):
                for kwargs in ({"seq_len": 1}, {"seq_len": 37}, {"cu_seqlens": [0, 5, 5, 22, 23]}):
                    got = sorted(i for r in range(world)
                                 for i in weft.ring_shard_indices(world, r, causal, **kwargs))
                    n = kwargs.get("seq_len") or kwargs["cu_seqlens"][-1]
                    self.assertEqual(got, list(range(n)), (world, causal, kwargs))

    def test_packed_documents_stay_apart(self):
        # Two documents of 4 tokens, 2 ranks, zigzag: each rank takes parts of both documents.
        self.assertEqual(weft.ring_shard_indices(2, 0, True, cu_seqlens=[0, 4, 8]), [0, 3, 4, 7])

    def test_errors(self):
        with self.assertRaises(weft.WeftValueError):
            weft.ring_shard_indices(0, 0, seq_len=8)
        with self.assertRaises(weft.WeftValueError):
            weft.ring_shard_indices(2, 2, seq_len=8)
        with self.assertRaises(weft.WeftValueError):
            weft.ring_shard_indices(2, 0, seq_len=8, cu_seqlens=[0, 8])
        with self.assertRaises(weft.WeftValueError):
            weft.ring_shard_indices(2, 0, cu_seqlens=[0, 5, 3])
        with self.assertRaises(weft.WeftTypeError):
            weft.ring_shard([1, 2, 3], 2, 0)


class OpTableTest(unittest.TestCase):
    """The torch operators' declarations (weft._op_table), made into operators only once torch is imported: every
    declaration complete, and its annotations (the operator's schema) resolvable in its module."""

    def test_import_leaves_torch_alone(self):
        code = "import sys, weft; from weft import _op_table; sys.exit('torch' in sys.modules)"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.assertEqual(subprocess.run([sys.executable, "-c", code], env=env).returncode, 0,
                         "import weft imported torch")

    def test_declarations_are_complete(self):
        from weft import _op_table
        names = [d.name for d in _op_table.DECLARATIONS]
        self.assertEqual(len(names), len(set(names)), "an operator declared twice")
        for expected in ("weft::all_reduce", "weft::all_gather_matmul", "weft::matmul_all_reduce",
                         "weft::flash_attention", "weft::context_attention", "weft::moe_dispatch", "weft::scaled_mm",
                         "weft::flash_decode", "weft::grouped_mm"):
            self.assertIn(expected, names)
        for d in _op_table.DECLARATIONS:
            self.assertTrue(d.name.startswith("weft::"), d.name)
            self.assertIsNotNone(d.fake, f"{d.name} has no fake implementation (torch.compile could not trace it)")
            self.assertEqual(d.backward is None, d.setup_context is None, f"{d.name}: backward without setup or back")

    def test_annotations_resolve_in_their_modules(self):
        """custom_op's schema inference evaluates each string annotation in the implementation's module: Tensor,
        Optional, ... must be there (torch.dtype through the module's torch, here a stand-in with a dtype)."""
        from weft import _op_table
        for d in _op_table.DECLARATIONS:
            namespace = dict(d.impl.__globals__, torch=types.SimpleNamespace(dtype=type("dtype", (), {})))
            try:
                hints = typing.get_type_hints(d.impl, globalns=namespace)
            except Exception as e:  # noqa: BLE001
                self.fail(f"{d.name}: its annotations do not resolve in {d.impl.__module__}: {e!r}")
            self.assertIn("return", hints, f"{d.name} has no return annotation")


if __name__ == "__main__":
    unittest.main()
