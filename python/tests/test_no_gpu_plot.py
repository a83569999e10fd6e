"""scripts/plot_bench.py on weft-bench --json output of each table kind (no GPU needed; skips without
matplotlib)."""
import importlib.util
import json
import os
import tempfile
import unittest

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "plot_bench.py")
_spec = importlib.util.spec_from_file_location("plot_bench", _SCRIPT)
plot_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_bench)

_RESULTS = {"machine": "test", "tables": [
    {"title": "all-reduce, bf16, 2 GPUs (single-process): weft vs NCCL 2.28.9", "note": "",
     "columns": ["size", "count", "type", "NCCL time us", "NCCL busbw", "weft time us", "weft algbw", "weft busbw",
                 "#wrong", "speedup", "% link"],
     "rows": [["8 KiB", "4096", "bf16", "6.9", "1.2", "3.5", "2.3", "2.3", "0", "1.97x", "1%"],
              ["1 GiB", "536870912", "bf16", "3300.0", "324.3", "2980.0", "360.3", "360.3", "0", "1.11x", "75%"]]},
    {"title": "all-gather, bf16, 2 virtual ranks on 1 GPU (single-process): weft vs NCCL 2.28.9", "note": "",
     "columns": ["size", "count", "type", "NCCL time us", "NCCL busbw", "weft time us", "weft algbw", "weft busbw",
                 "#wrong", "speedup", "% link"],
     "rows": [["8 KiB", "4096", "bf16", "-", "-", "9.9", "0.8", "0.6", "0", "-", "-"]]},
    {"title": "gemm: sweep, B [N,K], bf16 out", "note": "",
     "columns": ["M", "N", "K", "weft ms", "weft TFLOP/s", "cuBLAS TFLOP/s", "weft / cuBLAS"],
     "rows": [["8192", "8192", "8192", "1.5", "710.7", "693.8", "102.4%"], ["geomean", "", "", "", "", "", "100.7%"]]},
    {"title": "fused tensor-parallel ops, bf16, 2 GPUs", "note": "",
     "columns": ["op", "M", "N", "K", "sequential us", "compute us", "comm us", "weft us", "weft path", "speedup",
                 "weft / bound", "weft gemm us", "fused us", "pipelined us"],
     "rows": [["AG", "8192", "8192", "8192", "900.0", "700.0", "360.0", "785.5", "pipelined", "1.15x", "1.12",
               "690.0", "857.3", "785.5"]]},
    {"title": "latency: signal round trip", "note": "", "columns": ["pair", "us"], "rows": [["0-1", "2.6"]]},
]}


class PlotBench(unittest.TestCase):
    def test_every_known_table_becomes_a_png(self):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("matplotlib is not installed")
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "results.json")
            with open(src, "w") as f:
                json.dump(_RESULTS, f)
            out = os.path.join(d, "plots")
            self.assertEqual(plot_bench.main(["plot_bench.py", src, out]), 0)
            pngs = sorted(os.listdir(out))
            self.assertEqual(len(pngs), 4, pngs)  # the latency table has no plot
            for p in pngs:
                with open(os.path.join(out, p), "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_cells(self):
        self.assertEqual(plot_bench.size_bytes("8 KiB"), 8192)
        self.assertEqual(plot_bench.number("1.97x"), 1.97)
        self.assertIsNone(plot_bench.number("-"))


if __name__ == "__main__":
    unittest.main()
