# shellcheck shell=bash
# Shared by bench.sh and ab.sh (sourced): what a device tarball carries beside the binaries.

# Copies into DIR the shared libraries BIN resolves that the device image lacks: Debian's
# fmt/ICU/PCRE2 builds are not on it (Ubuntu-based CUDA image), so every resolved library except
# glibc, the C++ runtime and CUDA's own (the image has those).
carry_libs() {
  local bin=$1 dir=$2
  ldd "$bin" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcuda.so*|libcudart*|libcublas*|libnvidia*) ;;
      *) cp -L "$lib" "$dir/" ;;
    esac
  done
}

# The commit the binaries were built from, "-dirty" when sources differ from it.
build_commit() {
  local commit
  commit=$(git rev-parse HEAD)
  git diff --quiet HEAD -- src bench tests CMakeLists.txt || commit="$commit-dirty"
  echo "$commit"
}
