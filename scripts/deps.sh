#!/usr/bin/env bash
# Sourced by scripts/test and scripts/example: makes sure the Debian packages the build needs are
# installed. As root it installs what is missing; otherwise it prints the apt-get line and fails.
dparallel_packages=(
  cmake g++ make pkg-config
  clang                  # Debian's clang (14 on bookworm): the asan preset builds with it
  doxygen                # the API reference and its test (docs:api_reference)
  catch2                 # the test framework (Catch2 2.x)
  libopenblas-dev        # the example model's GEMM
  libopenmpi-dev openmpi-bin  # MPI process groups (dparallel::mpi, its tests, train_mlp --comm mpi)
  zlib1g-dev             # reading the gzip'ed IDX files
  dataset-fashion-mnist  # the reference data set
)

dparallel_ensure_packages() {
  local missing=()
  for p in "${dparallel_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "dparallel needs these Debian packages; install them with:" >&2
    echo "  sudo apt-get install -y ${missing[*]}" >&2
    return 1
  fi
  echo "Installing missing packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# scripts/bench plots its tables with gnuplot: its packages, on top of the build's.
dparallel_bench_packages=(
  gnuplot-nox            # the PNG plots of ./scripts/bench
)

dparallel_ensure_bench_packages() {
  dparallel_packages+=("${dparallel_bench_packages[@]}")
  dparallel_ensure_packages
}

# scripts/test runs every test: the libtorch adapter's and the comparisons with PyTorch too, so it
# installs their packages on top of the build's (without them those tests would not be built).
dparallel_test_packages=(
  libtorch-dev           # the libtorch adapter (dparallel::libtorch), its test and examples/train_torch
  python3-torch          # the comparisons with PyTorch (sampler, DP/DDP steps, optimizers, ZeRO-1, state dicts)
)

dparallel_ensure_test_packages() {
  dparallel_packages+=("${dparallel_test_packages[@]}")
  dparallel_ensure_packages
}

# .ci/run also packs the GPU check: its packages, on top of the tests'.
dparallel_ci_packages=(
  xz-utils python3       # scripts/gpu-pack compresses, scripts/gpu-check unpacks
  "${dparallel_test_packages[@]}"
)

dparallel_ensure_ci_packages() {
  dparallel_packages+=("${dparallel_ci_packages[@]}")
  # clang-16 (the `clang-16` preset) only when DPARALLEL_CI_CLANG asks for it.
  [[ " ${DPARALLEL_CI_CLANG:-} " == *" clang-16 "* ]] && dparallel_packages+=(clang-16)
  dparallel_ensure_packages
}
