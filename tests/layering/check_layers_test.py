#!/usr/bin/env python3
"""Tests of scripts/check_layers.py: it passes on the repository, and fails on a tree with a
deliberately wrong include (a lower layer including a higher one), naming the file and line,
with no exception for the model's GPU code."""
import pathlib
import subprocess
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_layers.py"


def run(root):
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True,
                          text=True, check=False)


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


class CheckLayersTest(unittest.TestCase):
    def assertRefused(self, root, *lines):
        """The check fails on the tree at `root`, its report naming each of `lines`."""
        r = run(root)
        self.assertEqual(r.returncode, 1, r.stdout)
        for line in lines:
            self.assertIn(line, r.stdout)

    def test_the_repository_holds_the_layering(self):
        r = run(ROOT)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_a_lower_layer_including_a_higher_one_fails(self):
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            write(root, "retrieval/src/ok.cc", '#include "kvr/model/model.h"\n')
            write(root, "decode-node/src/ok.cc", '#include "kvr/kv_store/client.h"\n')
            self.assertEqual(run(root).returncode, 0, run(root).stdout)
            # The model must not know a retrieval method.
            write(root, "model/src/bad.cc", '// x\n#include "kvr/retrieval/registry.h"\n')
            self.assertRefused(
                root, "model/src/bad.cc:2: model (layer 1) includes retrieval (layer 2)")

    def test_the_models_gpu_code_may_not_include_or_link_retrieval(self):
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            # What CudaModel did before its per-layer build hook: retrieval's build kernels.
            write(root, "model/cuda/cuda_model.cu", '#include "kvr/retrieval/cuda/build.cuh"\n')
            write(root, "model/cuda.cmake",
                  "add_library(kvr_model_cuda cuda/cuda_model.cu)\n"
                  "target_link_libraries(kvr_model_cuda PRIVATE kvr::retrieval_cuda_build)\n")
            write(root, "retrieval/cuda_build.cmake",
                  "add_library(kvr_retrieval_cuda_build cuda/summaries/quest.cu)\n"
                  "add_library(kvr::retrieval_cuda_build ALIAS kvr_retrieval_cuda_build)\n")
            self.assertRefused(
                root,
                "model/cuda/cuda_model.cu:1: model (layer 1) includes retrieval",
                "kvr_model_cuda (model, layer 1) links kvr::retrieval_cuda_build")

    def test_links_through_the_projects_wrappers_are_checked(self):
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            write(root, "kv-store/CMakeLists.txt",
                  "kvr_add_library(kv_store SOURCES src/store.cc PUBLIC kvr::common)\n")
            write(root, "controller/CMakeLists.txt",
                  "kvr_add_library(controller SOURCES src/c.cc PRIVATE kvr::kv_store)\n"
                  "kvr_add_executable(kvr-controller SOURCES src/main.cc LIBS kvr::controller)\n")
            write(root, "common/CMakeLists.txt",
                  "kvr_add_library(common SOURCES src/a.cc)\n")
            self.assertEqual(run(root).returncode, 0, run(root).stdout)
            # The store library may not link the controller (a library one layer up) ...
            write(root, "kv-store/CMakeLists.txt",
                  "kvr_add_library(kv_store SOURCES src/store.cc PUBLIC kvr::common\n"
                  "  PRIVATE kvr::controller)\n")
            self.assertRefused(
                root, "kvr_kv_store (kv-store, layer 4) links kvr::controller (controller")
            # ... nor may a program of a lower layer link a higher library.
            write(root, "kv-store/CMakeLists.txt",
                  "kvr_add_library(kv_store SOURCES src/store.cc PUBLIC kvr::common)\n"
                  "kvr_add_executable(store_tool SOURCES src/tool.cc LIBS kvr::controller)\n")
            self.assertRefused(root, "store_tool (kv-store, layer 4) links kvr::controller")

    def test_same_rank_components_may_not_include_each_other(self):
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            write(root, "decode-node/src/bad.cc", '#include "kvr/prefill_node/engine.h"\n')
            self.assertRefused(root, "decode-node/src/bad.cc:1")

    def test_the_store_library_is_below_the_node_library_and_its_binary_above(self):
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            # The kvr-store binary registers through the node library, like the other nodes.
            write(root, "kv-store/tools/main.cc", '#include "kvr/node/membership_client.h"\n'
                                                  '#include "kvr/kv_store/server.h"\n')
            write(root, "decode-node/src/main.cc", '#include "kvr/node/membership_client.h"\n')
            self.assertEqual(run(root).returncode, 0, run(root).stdout)
            # The store library knows no node library and no controller.
            write(root, "kv-store/src/bad.cc", '#include "kvr/node/membership_client.h"\n'
                                               '#include "kvr/controller/membership.h"\n')
            # The node library knows no controller.
            write(root, "node/src/bad.cc", '#include "kvr/controller/placement.h"\n')
            self.assertRefused(
                root,
                "kv-store/src/bad.cc:1: kv-store (layer 4) includes node (layer 5)",
                "kv-store/src/bad.cc:2: kv-store (layer 4) includes controller",
                "node/src/bad.cc:1: node (layer 5) includes controller (layer 6)")

    def test_links_point_down_like_includes(self):
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            write(root, "controller/CMakeLists.txt",
                  "add_library(kvr_controller src/membership.cc)\n"
                  "add_library(kvr::controller ALIAS kvr_controller)\n")
            write(root, "node/CMakeLists.txt",
                  "add_library(kvr_node src/membership_client.cc)\n"
                  "add_library(kvr::node ALIAS kvr_node)\n"
                  "target_link_libraries(kvr_node PUBLIC kvr::kv_store)\n")
            # The store binary (kv-store/tools) links the node library; the store library and
            # its tests link only what is below them.
            store = ("add_library(kvr_kv_store src/store.cc)\n"
                     "add_library(kvr::kv_store ALIAS kvr_kv_store)\n"
                     "# a comment naming kvr::controller links nothing\n"
                     "add_executable(kvr-store tools/kvr_store_main.cc)\n"
                     "target_link_libraries(kvr-store PRIVATE kvr::node kvr::kv_store)\n"
                     "kvr_add_test(store_test SOURCES tests/store_test.cc LIBS kvr::kv_store)\n")
            write(root, "kv-store/CMakeLists.txt", store)
            r = run(root)
            self.assertEqual(r.returncode, 0, r.stdout)
            write(root, "kv-store/CMakeLists.txt",
                  store + "target_link_libraries(kvr_kv_store PUBLIC kvr::controller)\n"
                          "kvr_add_test(bad_test SOURCES tests/bad_test.cc LIBS kvr::node)\n")
            self.assertRefused(
                root,
                "kvr_kv_store (kv-store, layer 4) links kvr::controller (controller, layer 6)",
                "bad_test (kv-store, layer 4) links kvr::node (node, layer 5)")


if __name__ == "__main__":
    unittest.main()
