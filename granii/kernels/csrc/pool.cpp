// A caching allocator for the large CPU tensors made while granii runs a layer.
//
// Why: glibc serves a request above its mmap threshold (32 MiB at most) with a fresh mapping, and
// every page of a fresh mapping faults on first touch. On this kind of machine a fresh 77 MB
// tensor is written at about 5 GB/s, a reused one at 30-45 GB/s: at N x 512 floats on a graph of
// 40,000 nodes the allocation costs as much as the GEMM that fills it. Keeping freed blocks for
// the next call removes that cost. Blocks are not advised as transparent huge pages: where the
// kernel compacts memory for such a region on its first fault (THP defrag "madvise", the common
// default) the first touch stalls instead: a new 39 MB block took 115 ms to fill where a plain
// one took 20 ms, and the reused block ran no faster (6.2 ms either way).
//
// How: once installed, this allocator is torch's CPU allocator for the rest of the process. On a
// thread that is inside granii's scope (GraniiPool_enter .. GraniiPool_leave, nested by a
// counter), a request of at least kMinBlock bytes is served from the cache of freed blocks (best
// fit, at most 25% larger) or a new 2 MiB-aligned block; every other request goes to the
// allocator that was installed before, unchanged. A block is returned to the cache by its
// deleter, whenever and on whatever thread the tensor dies. Raw allocations (DGL's arrays) are
// freed through raw_deleter(), which recognises the pool's blocks by address, so a block can
// never reach free() from another path and no address is ever taken for another's.
//
// Bounded: the bytes kept in the cache never exceed the limit (a quarter of physical memory, or
// GRANII_POOL_LIMIT); a block that would go over it is freed. release() frees the whole cache.
//
// Torch versions: c10::Allocator's interface changed in torch 2.3: allocate() is no longer const,
// and copy_data() (used to clone an allocation) became a pure virtual every allocator defines.
// GRANII_ALLOCATE_CONST follows torch/version.h; copy_data is defined without `override`, so it
// overrides where the base declares it and is an unused member where it does not. The rest of
// what the pool uses (GetCPUAllocator, GetDefaultCPUAllocator, SetCPUAllocator with a priority,
// raw_deleter, DataPtr's context) is the same in both; tested on torch 2.1.2 and 2.12.1.
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <torch/version.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

namespace granii {
namespace {

constexpr size_t kMinBlock = size_t(4) << 20;   // below this glibc's heap already reuses memory
constexpr size_t kAlign = size_t(2) << 20;      // a huge page

thread_local int scope_depth = 0;

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define GRANII_ALLOCATE_CONST
#else
#define GRANII_ALLOCATE_CONST const
#endif

class Pool final : public c10::Allocator {
 public:
  std::mutex mu;
  std::multimap<size_t, void*> cache;          // free blocks by size
  std::unordered_map<void*, size_t> live;      // blocks handed out, by address
  size_t cached = 0, limit = 0;
  size_t hits = 0, misses = 0;
  c10::Allocator* next = nullptr;              // the allocator installed before this one

  c10::DataPtr allocate(size_t nbytes) GRANII_ALLOCATE_CONST override {
    if (scope_depth <= 0 || nbytes < kMinBlock || limit == 0) return next->allocate(nbytes);
    return const_cast<Pool*>(this)->take(nbytes);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Pool::give_back; }
  // every block is plain host memory, the pool's and the next allocator's alike
  void copy_data(void* dest, const void* src, std::size_t count) const {  // NOLINT(modernize-use-override)
    std::memcpy(dest, src, count);
  }

  c10::DataPtr take(size_t nbytes) {
    size_t want = (nbytes + kAlign - 1) / kAlign * kAlign;
    void* p = nullptr;
    size_t size = 0;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = cache.lower_bound(want);
      if (it != cache.end() && it->first <= want + want / 4) {
        size = it->first;
        p = it->second;
        cache.erase(it);
        cached -= size;
        ++hits;
      } else {
        ++misses;
      }
    }
    if (p == nullptr) {
      size = want;
      p = std::aligned_alloc(kAlign, size);
      if (p == nullptr) {            // the cache may hold what the system no longer has
        release();
        p = std::aligned_alloc(kAlign, size);
      }
      TORCH_CHECK(p != nullptr, "granii: out of memory allocating ", nbytes, " bytes");
    }
    {
      std::lock_guard<std::mutex> g(mu);
      live.emplace(p, size);
    }
    return {p, p, &Pool::give_back, c10::Device(c10::DeviceType::CPU)};
  }

  static void give_back(void* p);

  size_t release() {
    std::multimap<size_t, void*> gone;
    {
      std::lock_guard<std::mutex> g(mu);
      gone.swap(cache);
      cached = 0;
    }
    size_t freed = 0;
    for (auto& kv : gone) {
      freed += kv.first;
      std::free(kv.second);
    }
    return freed;
  }
};

Pool* pool() {
  static Pool* p = new Pool();   // never destroyed: tensors may die after the interpreter
  return p;
}

void Pool::give_back(void* p) {
  if (p == nullptr) return;
  Pool* P = pool();
  {
    std::lock_guard<std::mutex> g(P->mu);
    auto it = P->live.find(p);
    if (it != P->live.end()) {
      size_t size = it->second;
      P->live.erase(it);
      if (P->cached + size <= P->limit) {
        P->cache.emplace(size, p);
        P->cached += size;
        return;
      }
      // over the limit: freed below, outside the lock
    } else {
      // not a pool block: a raw allocation of the allocator installed before
      c10::DeleterFnPtr d = P->next->raw_deleter();
      TORCH_INTERNAL_ASSERT(d != nullptr);
      d(p);
      return;
    }
  }
  std::free(p);
}

size_t default_limit() {
  const char* env = std::getenv("GRANII_POOL_LIMIT");
  if (env != nullptr && *env != '\0') return std::strtoull(env, nullptr, 10);
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? size_t(pages) * size_t(page) / 4 : size_t(1) << 30;
}

void lock_for_fork() { pool()->mu.lock(); }
void unlock_after_fork() { pool()->mu.unlock(); }

// 1 when installed (now or before), 0 when another allocator than torch's default is in place.
int install() {
  static int state = -1;
  if (state >= 0) return state;
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != c10::GetDefaultCPUAllocator()) return state = 0;
  Pool* P = pool();
  P->next = current;
  P->limit = default_limit();
  pthread_atfork(&lock_for_fork, &unlock_after_fork, &unlock_after_fork);
  c10::SetCPUAllocator(P, /*priority=*/0);
  return state = c10::GetCPUAllocator() == P ? 1 : 0;
}

}  // namespace
}  // namespace granii

// C entry points for module.cpp (plain functions: called twice per layer call, they must be cheap)
extern "C" {
int GraniiPool_install() { return granii::install(); }
void GraniiPool_enter() { ++granii::scope_depth; }
void GraniiPool_leave() { --granii::scope_depth; }
size_t GraniiPool_release() { return granii::pool()->release(); }
void GraniiPool_set_limit(size_t bytes) {
  granii::Pool* P = granii::pool();
  {
    std::lock_guard<std::mutex> g(P->mu);
    P->limit = bytes;
  }
  if (P->cached > bytes) P->release();
}
// cached bytes, live blocks' bytes, limit, hits, misses
void GraniiPool_stats(size_t* out) {
  granii::Pool* P = granii::pool();
  std::lock_guard<std::mutex> g(P->mu);
  size_t live = 0;
  for (auto& kv : P->live) live += kv.second;
  out[0] = P->cached;
  out[1] = live;
  out[2] = P->limit;
  out[3] = P->hits;
  out[4] = P->misses;
}
}
