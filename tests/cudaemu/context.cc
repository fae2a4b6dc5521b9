// Coroutines for the emulated CUDA threads: a pool of stacks, each with a PROT_NONE guard page
// below it (an overflow is a clean "stack overflow" message, not silent corruption), and the
// switch between them. On x86-64 the switch is ten instructions saving the callee-saved
// registers (glibc's swapcontext also saves the signal mask: a system call per switch, measured
// ~15x slower, docs/cudaemu.md); elsewhere, or with -DCUDAEMU_UCONTEXT, ucontext is used.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "core.h"

#if defined(__x86_64__) && !defined(CUDAEMU_UCONTEXT)
#define CUDAEMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace cudaemu {
namespace {

struct stack_rec {
  char *map = nullptr;  // guard page, then the stack
  size_t bytes = 0;     // stack bytes, guard excluded
};
std::vector<stack_rec> stacks;

size_t page_size() {
  static const size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

stack_rec &stack_at(int i) {
  if ((size_t)i >= stacks.size()) stacks.resize((size_t)i + 1);
  stack_rec &s = stacks[(size_t)i];
  if (!s.map) {
    const size_t page = page_size();
    s.bytes = (config().stack_bytes + page - 1) / page * page;
    void *m = mmap(nullptr, s.bytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (m == MAP_FAILED) fatal("cannot map a %zu-byte coroutine stack", s.bytes);
    if (mprotect(m, page, PROT_NONE)) fatal("cannot protect a coroutine stack's guard page");
    s.map = static_cast<char *>(m);
  }
  return s;
}

}  // namespace

void *stack_base(int i) { return stack_at(i).map + page_size(); }

bool in_stack_guard(const void *p, int *which) {
  const char *c = static_cast<const char *>(p);
  for (size_t i = 0; i < stacks.size(); i++)
    if (stacks[i].map && c >= stacks[i].map && c < stacks[i].map + page_size()) {
      *which = (int)i;
      return true;
    }
  return false;
}

#ifdef CUDAEMU_ASM_SWITCH
// cudaemu_switch(void **save_sp, void *new_sp): push the callee-saved registers, MXCSR and the
// x87 control word, store rsp, load the other stack's, pop its registers, return into it.
extern "C" void cudaemu_switch(void **save_sp, void *new_sp);
asm(R"(
  .text
  .globl cudaemu_switch
  .type cudaemu_switch, @function
cudaemu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cudaemu_switch, .-cudaemu_switch
)");

void context_init(context *c, int stack, void (*entry)()) {
  stack_rec &s = stack_at(stack);
  // The top 16-aligned; `entry` is entered by cudaemu_switch's ret with rsp ≡ 8 (mod 16), as
  // after a call, above a zero return address it must never use.
  uintptr_t top = (uintptr_t)(s.map + page_size() + s.bytes) & ~(uintptr_t)15;
  uint64_t *sp = reinterpret_cast<uint64_t *>(top);
  *--sp = 0;                              // entry's return address: entry never returns
  *--sp = (uint64_t)entry;                // cudaemu_switch's ret goes here
  for (int r = 0; r < 6; r++) *--sp = 0;  // rbp rbx r12 r13 r14 r15
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  --sp;
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char *>(sp) + 4, &fpucw, 2);
  c->sp = sp;
}

void context_switch(context *from, context *to) { cudaemu_switch(&from->sp, to->sp); }
const char *context_kind() { return "x86-64 register switch"; }

#else

namespace {
std::vector<ucontext_t> contexts(1024);  // one per stack: sized once, never moved
ucontext_t scheduler_ctx;
}  // namespace

void context_init(context *c, int stack, void (*entry)()) {
  stack_rec &s = stack_at(stack);
  ucontext_t *u = &contexts[(size_t)stack];
  getcontext(u);
  u->uc_stack.ss_sp = s.map + page_size();
  u->uc_stack.ss_size = s.bytes;
  u->uc_link = nullptr;
  makecontext(u, entry, 0);
  c->sp = u;
}

void context_switch(context *from, context *to) {
  if (!from->sp) from->sp = &scheduler_ctx;
  swapcontext(static_cast<ucontext_t *>(from->sp), static_cast<ucontext_t *>(to->sp));
}
const char *context_kind() { return "ucontext (swapcontext)"; }

#endif

}  // namespace cudaemu
