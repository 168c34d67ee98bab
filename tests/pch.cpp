// The precompiled header of the tests (tests/CMakeLists.txt, dparallel_test_pch) needs one source.
