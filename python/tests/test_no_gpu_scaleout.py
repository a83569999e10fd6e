"""scripts/scaleout_model.py (a model of weft's hierarchical collectives across nodes): its sizes, its
invariants (no network leg on one node, MoE aggregation never sends more than the plain all-to-all, more
nodes never make a call faster at a fixed size per GPU) and its table."""
import contextlib
import importlib.util
import io
import os
import unittest

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "scaleout_model.py")
_spec = importlib.util.spec_from_file_location("scaleout_model", _PATH)
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)


def machine(nodes, g=8):
    return model.Machine(nodes, g, net_gbps=400, net_efficiency=0.9, net_latency_us=8, chunks=8)


class ScaleoutModel(unittest.TestCase):
    def test_sizes(self):
        self.assertEqual(model.parse_size("64M"), 64 << 20)
        self.assertEqual(model.parse_size("1GiB"), 1 << 30)
        self.assertEqual(model.parse_size("4096"), 4096)
        self.assertEqual(model.human(1 << 30), "1 GiB")

    def test_one_node_has_no_network_leg(self):
        m = machine(1)
        s = 64 << 20
        self.assertAlmostEqual(m.all_to_all(s), m.node_leg("all_to_all", 7 / 8, s))
        self.assertLess(m.all_reduce(s), 2 * m.node_leg("all_reduce", 1, s))

    def test_invariants(self):
        for s in (1 << 20, 64 << 20, 1 << 30):
            last = {}
            for n in (2, 4, 8, 16):
                m = machine(n)
                self.assertLessEqual(m.moe_dispatch(s, 8, 256), m.all_to_all(s) + 1e-9)
                self.assertGreater(m.moe_every_node(s, 8), 0)
                for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                    t = getattr(m, op)(s)
                    self.assertGreater(t, 0)
                    self.assertGreater(m.flat(op, s), 0)
                    if op in last:
                        self.assertGreaterEqual(t, last[op] - 1e-9, f"{op} {s} faster at {n} nodes")
                    last[op] = t

    def test_gemm_ops(self):
        """The overlapped all_gather_matmul is never slower than its GEMM or its all-gather alone, nor than the
        flat collective and the GEMM in sequence; matmul_reduce_scatter (not overlapped across nodes yet) is
        the GEMM plus the reduce-scatter."""
        for n in (2, 8):
            m = machine(n)
            for s in (1 << 20, 64 << 20, 1 << 30):
                gemm = m.gemm_us(s, 8192, 700)
                ag = m.all_gather_matmul(s, 8192, 700)
                self.assertGreaterEqual(ag, max(gemm, m.all_gather(s)))
                self.assertLessEqual(ag, gemm + m.all_gather(s) + gemm / m.chunks + 1e-9)
                self.assertAlmostEqual(m.matmul_reduce_scatter(s, 8192, 700), gemm + m.reduce_scatter(s))

    def test_table_prints_marked_as_a_model(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(model.main(["--nodes", "2", "--sizes", "1M"]), 0)
        text = out.getvalue()
        self.assertIn("MODEL (not a measurement)", text)
        self.assertEqual(text.count("| 2 | 16 |"), 8)


if __name__ == "__main__":
    unittest.main()
