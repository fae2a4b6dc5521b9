#!/bin/sh
# cu2cc.py, the .cu -> C++ rewriter: what it rewrites keeps the line numbers of the .cu file,
# and each construct the emulation cannot execute (or the rewriter cannot parse) is an error
# naming the file and line, never silently different code. Also: src/ and gpu/ never mention the
# emulation, and its sources are clang-formatted (STYLE.md rule 12).
. "$TESTDIR/tap.sh"
cd "$WORK" || exit 1
R="$EMU_SRC/cu2cc.py"
# refuse NAME LINE NEEDLE: the snippet in NAME.cu must fail at line LINE with NEEDLE
refuse() {
  out=$("$PYTHON3" "$R" "$1.cu" "$1.cpp" 2>&1); rc=$?
  if [ "$rc" -eq 0 ]; then not_ok "$1: refused" "$out"
  elif ! printf '%s' "$out" | grep -qF "$1.cu:$2:"; then not_ok "$1: error at line $2" "$out"
  elif ! printf '%s' "$out" | grep -qF -- "$3"; then not_ok "$1: says '$3'" "$out"
  elif [ -e "$1.cpp" ]; then not_ok "$1: no output left behind" "$out"
  else ok "$1: refused at $1.cu:$2 ($3)"; fi
}
printf '__global__ void k(int *p) {\n  asm volatile("trap;");\n}\n' > inline_ptx.cu
refuse inline_ptx 2 "inline PTX"
printf '__shared__ float s[32];\n__global__ void k(float *p) { p[0] = s[0]; }\n' > file_scope_shared.cu
refuse file_scope_shared 1 "outside a function"
printf '__global__ void k(float *p) {\n  __shared__ float s = 1.0f;\n  p[0] = s;\n}\n' > initialised_shared.cu
refuse initialised_shared 2 "initializer"
printf '__global__ void k(float *p) {\n  p[0] = __shfl(p[0], 1);\n}\n' > old_shuffle.cu
refuse old_shuffle 2 "without _sync"
printf '__global__ void k(float *p) { p[0] = 1; }\nvoid f(float *p) {\n  k<<<1>>>(p);\n}\n' > short_config.cu
refuse short_config 3 "2 to 4 parts"
printf '__global__ void k(float *p) { p[0] = 1; }\nvoid f(float *p) {\n  (k)<<<1, 1>>>(p);\n}\n' > unnamed_kernel.cu
refuse unnamed_kernel 3 "kernel's name"
printf '#include <mma.h>\nusing namespace nvcuda;\n__global__ void k() {\n  wmma::fragment<int> f;\n}\n' > tensor_cores.cu
refuse tensor_cores 4 "tensor-core"
printf '__constant__ float c[4];\n' > constant_memory.cu
refuse constant_memory 1 "__constant__"
# what it rewrites: same line count, a #line pointing at the .cu, launches and shared memory
printf '// a launch over two lines, a shared tile, a string with <<<\n#include <cuda_runtime.h>\ntemplate <int D>\n__global__ void k(float *p) {\n  __shared__ float a[D], b[2][D];\n  extern __shared__ float dyn[];\n  p[threadIdx.x] = a[0] + b[1][0] + dyn[0];\n}\nvoid f(float *p) {\n  const char *s = "<<<";\n  k<4>\n      <<<1, 32, 16>>>(p);\n  k<8><<<dim3(1, 2), 32>>>(p);\n}\n' > good.cu
if "$PYTHON3" "$R" good.cu good.cpp 2> err.txt; then
  lines_cu=$(wc -l < good.cu); lines_cc=$(($(wc -l < good.cpp) - 2))
  if [ "$lines_cu" -eq "$lines_cc" ] && grep -q '^#line 1 "good.cu"' good.cpp &&
     [ "$(grep -c 'cudaemu::launch(' good.cpp)" -eq 2 ] && grep -q 'shared<float\[D\]>' good.cpp &&
     grep -q 'shared<float\[2\]\[D\]>' good.cpp && grep -q 'dynamic_shared' good.cpp &&
     grep -q 'CUDAEMU_KERNEL_ENTRY' good.cpp && grep -q '"<<<"' good.cpp; then
    ok "a valid file: launches, shared memory and kernel names rewritten, lines kept"
  else not_ok "a valid file is rewritten as expected" "$(cat good.cpp)"; fi
else not_ok "a valid file is accepted" "$(cat err.txt)"; fi
# a compiler error in rewritten code points at the .cu line
printf '#include <cuda_runtime.h>\n__global__ void k(float *p) {\n  p[0] = undeclared_name;\n}\n' > bad_code.cu
"$PYTHON3" "$R" bad_code.cu bad_code.cpp
out=$(${CXX:-c++} -std=c++17 -I"$EMU_SRC/include" -fsyntax-only bad_code.cpp 2>&1)
if printf '%s' "$out" | grep -q "bad_code.cu:3:"; then ok "compiler errors point at the .cu line"
else not_ok "compiler errors point at the .cu line" "$out"; fi
# a test harness, not a product path: no code in src/ or gpu/ knows the emulation exists
if hits=$(grep -rli --include='*.[ch]' --include='*.cu' 'cudaemu' "$SRCDIR/src" "$SRCDIR/gpu"); then
  not_ok "the code of src/ and gpu/ does not mention the CUDA emulation" "$hits"
else ok "the code of src/ and gpu/ does not mention the CUDA emulation"; fi
# the emulation's sources are formatted as .clang-format says
if command -v clang-format > /dev/null 2>&1; then
  bad=""
  for f in "$EMU_SRC"/*.cc "$EMU_SRC"/*.h "$EMU_SRC"/*.c "$EMU_SRC"/*.cu "$EMU_SRC"/include/*.h; do
    clang-format --style=file --dry-run --Werror "$f" > /dev/null 2>&1 || bad="$bad ${f#"$EMU_SRC"/}"
  done
  if [ -z "$bad" ]; then ok "tests/cudaemu is clang-formatted"
  else not_ok "tests/cudaemu is clang-formatted (make format):$bad"; fi
else
  not_ok "clang-format is installed"
fi
tap_done
