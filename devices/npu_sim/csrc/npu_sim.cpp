// The simulated Ascend NPU: a PrivateUse1 device whose tensors live in their own counted host buffers.
//
// Pieces, after PyTorch's out-of-tree registration example (test/cpp_extensions/open_registration_extension):
//   * a caching allocator (allocated vs reserved, empty_cache) over resident host memory (2 MiB pages where the
//     host has transparent huge pages), with a per-device capacity; past it the cache is released and the
//     allocation retried, then OutOfMemoryError; free blocks keep a bounded amount of host memory resident,
//     giving back the pages of the least recently freed first (see cache_resident_limit);
//   * a device guard (thread-local current device and stream; events and streams are no-op-correct, since
//     every operator runs synchronously on the host);
//   * a hooks object (device count, pinned host memory, storage resize, the default generator);
//   * the factory / copy / view kernels, `_has_compatible_shallow_copy_type` (npu and cpu strided tensors
//     are compatible, as torch_npu registers), and a boxed fallback for every other operator that runs its
//     cpu kernel on cpu views of the npu bytes (see sim_fallback), refusing first an operator whose tensors sit on
//     two devices, as a device would (see check_one_device);
// The Python side (devices/npu_sim/__init__.py, whose docstring says why this route and not the pure-Python backend)
// renames PrivateUse1 to "npu", registers torch.npu (devices/npu_sim/module.py) and hccl (devices/npu_sim/backend.py).

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/NativeFunctions.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kMaxDevices = 64;
constexpr size_t kAlignment = 64;

int g_device_count = 1;
thread_local c10::DeviceIndex t_current_device = 0;
thread_local int64_t t_current_stream[kMaxDevices] = {0};

struct DeviceCounters {
  std::atomic<int64_t> allocated{0};      // bytes of blocks handed out (block sizes, as torch_npu counts)
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> reserved{0};       // bytes of blocks held: handed out + cached
  std::atomic<int64_t> reserved_peak{0};
  std::atomic<int64_t> capacity{int64_t(8) << 30};
  std::atomic<int64_t> alloc_count{0};
  std::atomic<int64_t> free_count{0};
  std::atomic<int64_t> segment_count{0};  // blocks obtained from the host (cudaMalloc / aclrtMalloc calls)
  std::atomic<int64_t> release_count{0};  // blocks returned to the host (empty_cache, or retry before OOM)
  std::atomic<int64_t> retries{0};
  std::atomic<int64_t> dropped_bytes{0};      // bytes of cached blocks whose pages were given back (resident limit)
  std::atomic<int64_t> repopulated_bytes{0};  // bytes of such blocks made resident again when taken back into use
  std::atomic<int64_t> ooms{0};
};
DeviceCounters g_counters[kMaxDevices];

// A RuntimeError, as torch_npu's device checks raise, naming the index and the valid range.
void check_index(int64_t index) {
  TORCH_CHECK(index >= 0 && index < g_device_count, "Invalid device argument ", index, ": npu-sim has ",
              g_device_count, " devices in this process (valid indices 0..", g_device_count - 1,
              "; HAL_SIM_NPU_COUNT / ASCEND_RT_VISIBLE_DEVICES)");
}

// The index of ``d`` for the noexcept stream calls: its own when in range, else the current device.
c10::DeviceIndex stream_slot(c10::DeviceIndex d) noexcept {
  return d >= 0 && d < g_device_count ? d : t_current_device;
}

void raise_peak(std::atomic<int64_t>& peak, int64_t now) {
  int64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

// ---------------------------------------------------------------- resident host memory
// Device memory is resident once allocated: no page faults when a kernel first writes it. Large blocks are
// mapped and populated at once (MADV_POPULATE_WRITE), so the cost of making memory resident is paid in bulk
// at allocation, as a device allocator pays it, and never again. Populating is the kernel's page-fault path
// (allocate, zero and map each 4 KiB page) and costs more than copying the same bytes, so a large block is
// populated by several threads at once, each over its own slice of the range: the parallel first touch
// PyTorch's CUDA host allocator does before registering memory (pinned_num_register_threads).
constexpr size_t kMapThreshold = size_t(1) << 20;
constexpr size_t kPopulateSlice = size_t(8) << 20;  // bytes per populating thread, at least

// Threads that populate a block of ``size`` bytes: one per kPopulateSlice, at most the host's hardware
// threads (or HAL_SIM_POPULATE_THREADS when set, 1 turning the parallel touch off).
size_t populate_threads(size_t size) {
  static const size_t limit = [] {
    const char* env = std::getenv("HAL_SIM_POPULATE_THREADS");
    long n = env != nullptr ? std::strtol(env, nullptr, 10) : 0;
    if (n <= 0) n = static_cast<long>(std::thread::hardware_concurrency());
    return static_cast<size_t>(std::clamp<long>(n, 1, 64));
  }();
  return std::max<size_t>(1, std::min(limit, size / kPopulateSlice));
}

void populate_range(char* p, size_t size) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  if (madvise(p, size, MADV_POPULATE_WRITE) != 0) {  // older kernels: touch every page instead
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t off = 0; off < size; off += page) static_cast<volatile char*>(p)[off] = 0;
  }
}

// Makes ``size`` bytes at page-aligned ``p`` resident, split over populate_threads(size) threads. Slices of a
// range of whole 2 MiB pages (a device block, see map_huge_aligned) are whole 2 MiB pages each, so no huge page
// is faulted by two threads.
void populate(void* p, size_t size) {
  const size_t n = populate_threads(size);
  constexpr size_t kTwoMiB = size_t(2) << 20;
  const bool whole_huge = reinterpret_cast<uintptr_t>(p) % kTwoMiB == 0 && size % kTwoMiB == 0;
  const size_t page = whole_huge ? kTwoMiB : static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t slice = (size / n + page - 1) / page * page;
  std::vector<std::thread> workers;
  workers.reserve(n - 1);
  auto* base = static_cast<char*>(p);
  for (size_t i = 1; i < n && i * slice < size; ++i) {
    workers.emplace_back(populate_range, base + i * slice, std::min(slice, size - i * slice));
  }
  populate_range(base, std::min(slice, size));
  for (auto& w : workers) w.join();
}

// With HAL_SIM_HUGE_PAGES=1, device blocks are backed by 2 MiB pages where the host allows it (transparent huge
// pages, THP, in "madvise" or "always" mode), as a GPU driver maps device memory in 2 MiB pages. Off by default:
// on a host whose memory has been in use for hours (fragmented), each huge-page fault compacts memory first, and
// the engine's warm offload round trip of `hal bench --only offload --device npu-sim` measured 0.57-0.70x a
// plain copy with them against 0.77-0.89x with 4 KiB pages (same host, same hour, interleaved runs). For
// the host this makes the bulk paths of the resident cache cheap: populating a block zeroes one 2 MiB page per
// fault instead of 512 small ones, and giving its pages back (MADV_DONTNEED) frees 2 MiB at a time. Measured on
// a 2-core EPYC VM (512 MiB, MADV_POPULATE_WRITE then MADV_DONTNEED): 2.2-2.5 GB/s and 12.5 GB/s with 4 KiB
// pages, 7-11 GB/s and about 350 GB/s with 2 MiB pages; an engine's warm onload that repopulated 224 MiB of
// dropped blocks went from 0.20 s to 0.12 s (a plain copy of the same 884 MiB: 0.10 s). Blocks are then multiples
// of 2 MiB (round_size) and start on a 2 MiB boundary, so no huge page straddles two blocks or holds bytes
// the block does not count. Where the kernel finds no free huge page it falls back to 4 KiB pages.
constexpr size_t kHugePage = size_t(2) << 20;

bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* env = std::getenv("HAL_SIM_HUGE_PAGES");
    return env != nullptr && std::strtol(env, nullptr, 10) != 0;
  }();
  return wanted;
}

// Huge pages only while the host has room: with THP's defrag in "madvise" mode (this host's, and the kernel's
// default) a fault in a MADV_HUGEPAGE region compacts memory synchronously when no free 2 MiB page is at hand,
// and a job that fills the host stalls on it: the README's npu-sim hybrid run (21 GB of a 24 GB host) took
// 466 s with huge pages throughout, its onloads up to 73 s, against 252 s with 4 KiB pages. Below the reserve
// a block takes (or, repopulated, goes back to) 4 KiB pages.
int64_t meminfo_bytes(const char* field) {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t out = -1;
  const size_t n = std::strlen(field);
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      out = std::strtoll(line + n + 1, nullptr, 10) * 1024;  // kB there
      break;
    }
  }
  std::fclose(f);
  return out;
}

// Whether a block of ``size`` bytes may be backed by huge pages now: wanted, and the host's available memory
// (MemAvailable) stays above a reserve of a quarter of its memory (at least 4 GiB) once the block is resident.
bool huge_pages_now(size_t size) {
  if (!huge_pages_wanted()) return false;
  static const int64_t total = meminfo_bytes("MemTotal");
  const int64_t available = meminfo_bytes("MemAvailable");
  if (total < 0 || available < 0) return true;
  const int64_t reserve = std::max<int64_t>(int64_t(4) << 30, total / 4);
  return available - static_cast<int64_t>(size) >= reserve;
}

// ``size`` bytes of fresh anonymous memory starting on a 2 MiB boundary (so whole huge pages back it), or
// nullptr: the mapping is made 2 MiB longer and trimmed at both ends.
void* map_huge_aligned(size_t size) {
  const size_t span = size + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + span;
  if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
  void* p = reinterpret_cast<void*>(aligned);
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif
  madvise(p, size, MADV_HUGEPAGE);  // refused (EINVAL) where THP is compiled out: 4 KiB pages then
  return p;
}

// ``size`` bytes, all resident; ``*mapped`` tells resident_free how to free them. ``huge``: a device block
// (a multiple of 2 MiB from 1 MiB up, see round_size) that may be backed by huge pages.
void* resident_alloc(size_t size, bool* mapped, bool huge = false) {
  if (size < kMapThreshold) {
    *mapped = false;
    void* p = std::aligned_alloc(kAlignment, size);
    if (p != nullptr) std::memset(p, 0, size);
    return p;
  }
  *mapped = true;
  void* p = nullptr;
  if (huge && size % kHugePage == 0 && huge_pages_now(size)) {
    p = map_huge_aligned(size);
  } else {
    p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) p = nullptr;
  }
  if (p == nullptr) return nullptr;
  populate(p, size);
  return p;
}

void resident_free(void* p, size_t size, bool mapped) {
  if (mapped) {
    munmap(p, size);
  } else {
    std::free(p);
  }
}

// ---------------------------------------------------------------- device memory: a caching allocator
// After PyTorch's CUDA caching allocator, which torch_npu's NPU allocator follows: requests are rounded
// (512 B below 1 MiB, 2 MiB above), a freed block goes back to a per-device cache instead of the host, and
// a request reuses the smallest cached block that fits (at most 1/8 larger; a resident one first, see Pool).
// memory_allocated counts blocks in use, memory_reserved blocks in use plus cached; empty_cache() returns
// cached blocks to the host. Past the capacity the cache is released and the allocation retried once, then OutOfMemoryError.
struct Block;
using SizeMap = std::multimap<size_t, Block*>;
struct Pool;

struct Block {
  size_t size;
  c10::DeviceIndex device;
  bool mapped;
  void* ptr;
  bool resident = true;  // its pages are in host memory (false: given back with MADV_DONTNEED while cached)
  Pool* pool = nullptr;  // the pool holding it while not in use (cache or released), else nullptr
  SizeMap::iterator slot;  // its entry in that pool
  std::list<Block*>::iterator lru;  // its entry in g_lru while resident, mapped and not in use
};

// Blocks not in use (cached, or released to the simulated device), by size, resident ones apart from those
// whose pages were given back, so that a request takes a resident block whenever one fits and repopulates
// one only when none does.
struct Pool {
  SizeMap resident, dropped;

  bool empty() const { return resident.empty() && dropped.empty(); }

  void put(Block* block) {
    block->slot = (block->resident ? resident : dropped).emplace(block->size, block);
    block->pool = this;
  }

  // The smallest resident block that fits ``size`` (at most 1/8 larger), else the smallest such dropped
  // block, removed from the pool; nullptr when none fits.
  Block* take(size_t size) {
    for (SizeMap* blocks : {&resident, &dropped}) {
      auto it = blocks->lower_bound(size);
      if (it != blocks->end() && it->first <= size + size / 8) {
        Block* block = it->second;
        blocks->erase(it);
        block->pool = nullptr;
        return block;
      }
    }
    return nullptr;
  }

  // ``block`` (resident, in this pool) gave its pages back: it moves to the dropped ones.
  void mark_dropped(Block* block) {
    resident.erase(block->slot);
    block->slot = dropped.emplace(block->size, block);
  }

  // Every block, resident or not, moved into ``other`` (which keeps their residency).
  void move_all_to(Pool& other, const std::function<void(Block*)>& each) {
    for (SizeMap* blocks : {&resident, &dropped}) {
      for (auto& entry : *blocks) {
        each(entry.second);
        other.put(entry.second);
      }
      blocks->clear();
    }
  }
};

// Host memory the cache may keep resident per device, in bytes, over blocks not in use (HAL_SIM_CACHE_RESIDENT_MB,
// default 1024). On a device, cached blocks cost device memory only; here they cost the host's, and a
// process that builds a model in fp32 and casts it (or trains, frees and re-allocates) would keep all of it
// resident for nothing: the default job's rollouts held 4 GiB cached against 1 GiB in use. Past the limit the
// blocks parked longest ago give their pages back (least recently used first, as a cache evicts): they keep
// their addresses and stay cached (reserved, as on a device); taking one again makes it resident in bulk, as
// a fresh block is, and a request takes a resident block over a dropped one whenever both fit (Pool::take).
// The most recently freed blocks stay resident because they are the likeliest to be asked for again: an
// engine's offload frees its tensors' blocks and its onload asks for the same sizes. Giving back the newest
// block instead (as this allocator first did) kept a step's stale temporaries resident and made the onload
// repopulate what its offload had just freed: a 128 MiB model with grads and AdamW states after a step with
// 1 GiB of activations repopulated about 400 MiB per warm onload, against none now.
int64_t cache_resident_limit() {
  static const int64_t limit = [] {
    const char* env = std::getenv("HAL_SIM_CACHE_RESIDENT_MB");
    long mb = env != nullptr ? std::strtol(env, nullptr, 10) : 1024;
    return static_cast<int64_t>(std::max<long>(mb, 0)) << 20;
  }();
  return limit;
}
int64_t g_cached_resident[kMaxDevices] = {0};  // bytes of resident blocks not in use, per device (under g_alloc_mutex)
std::list<Block*> g_lru[kMaxDevices];  // resident mapped blocks not in use, least recently parked first (same)

// A block goes out of use (into a pool, already put there): counted as resident cache; past the limit the
// least recently parked mapped blocks give their pages back (this one too, if it alone is over the limit).
// Small (malloc'ed) blocks are counted but never given back, as before: they hold whole pages only in part.
void park_locked(Block* block) {
  if (!block->resident) return;
  auto& held = g_cached_resident[block->device];
  auto& lru = g_lru[block->device];
  held += static_cast<int64_t>(block->size);
  if (block->mapped) block->lru = lru.insert(lru.end(), block);
  while (held > cache_resident_limit() && !lru.empty()) {
    Block* victim = lru.front();
    lru.pop_front();
#ifndef MADV_DONTNEED
#define MADV_DONTNEED 4
#endif
    madvise(victim->ptr, victim->size, MADV_DONTNEED);
    victim->resident = false;
    held -= static_cast<int64_t>(victim->size);
    g_counters[victim->device].dropped_bytes += static_cast<int64_t>(victim->size);
    victim->pool->mark_dropped(victim);
  }
}

// A block taken out of its pool comes back into use: resident again (in bulk) if its pages were given back.
void unpark_locked(Block* block) {
  if (block->resident) {
    g_cached_resident[block->device] -= static_cast<int64_t>(block->size);
    if (block->mapped) g_lru[block->device].erase(block->lru);
    return;
  }
#ifndef MADV_NOHUGEPAGE
#define MADV_NOHUGEPAGE 15
#endif
  if (block->mapped && reinterpret_cast<uintptr_t>(block->ptr) % kHugePage == 0 && block->size % kHugePage == 0 &&
      huge_pages_wanted()) {  // a device block: 2 MiB pages again only while the host has room (huge_pages_now)
    madvise(block->ptr, block->size, huge_pages_now(block->size) ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  }
  populate(block->ptr, block->size);
  block->resident = true;
  g_counters[block->device].repopulated_bytes += static_cast<int64_t>(block->size);
}

std::mutex g_alloc_mutex;
Pool g_cache[kMaxDevices];  // cached (free) blocks, still reserved

// A request's block size: small ones in 512-byte steps (as the CUDA caching allocator), mapped ones in whole
// pages: 2 MiB with HAL_SIM_HUGE_PAGES=1 (a block is then whole huge pages), else 4 KiB. A block is not split,
// so the rounding is held for nothing: at 2 MiB it was 14% of the offload benchmark's 288 tensors (1014 MiB
// in 1153 MiB of blocks), which then no longer fitted the resident limit and were faulted in again each onload.
size_t round_size(size_t nbytes) {
  if (nbytes < kMapThreshold) return std::max<size_t>(512, (nbytes + 511) / 512 * 512);
  const size_t page = huge_pages_wanted() ? kHugePage : size_t(4096);
  return (nbytes + page - 1) / page * page;
}

// Memory the simulated device has released (empty_cache) but that stays resident, as HBM stays the
// device's after cudaFree/aclrtFree: it no longer counts as reserved, and a later allocation of a fitting
// size takes it back without paying host page faults again (up to the resident limit above). By size, like the cache.
Pool g_device_free[kMaxDevices];

// Returns cached blocks of ``device`` to the simulated device (no longer reserved); caller holds g_alloc_mutex.
void release_cached_locked(c10::DeviceIndex device) {
  auto& c = g_counters[device];
  // still parked, in the same place of the LRU order: cached and released blocks count alike
  g_cache[device].move_all_to(g_device_free[device], [&c](Block* block) {
    c.reserved -= static_cast<int64_t>(block->size);
    c.release_count += 1;
  });
}

// A released block of ``device`` that fits ``size`` (at most 1/8 larger, resident first), or nullptr; caller
// holds the mutex.
Block* take_device_free_locked(c10::DeviceIndex device, size_t size) {
  Block* block = g_device_free[device].take(size);
  if (block != nullptr) unpark_locked(block);
  return block;
}

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  auto& c = g_counters[block->device];
  c.allocated -= static_cast<int64_t>(block->size);
  c.free_count += 1;
  g_cache[block->device].put(block);
  park_locked(block);
}

void free_nothing(void*) {}

class SimAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex device = t_current_device;
    // No block for an empty storage (as the CUDA caching allocator): a null pointer that still names the device.
    if (nbytes == 0) return {nullptr, nullptr, &free_nothing, c10::Device(c10::DeviceType::PrivateUse1, device)};
    auto& c = g_counters[device];
    const size_t size = round_size(nbytes);
    Block* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_alloc_mutex);
      auto& cache = g_cache[device];
      block = cache.take(size);
      if (block != nullptr) {
        unpark_locked(block);
      } else {
        if (c.reserved.load() + static_cast<int64_t>(size) > c.capacity.load() && !cache.empty()) {
          c.retries += 1;
          release_cached_locked(device);
        }
        if (c.reserved.load() + static_cast<int64_t>(size) > c.capacity.load()) {
          c.ooms += 1;
          TORCH_CHECK_WITH(OutOfMemoryError, false, "npu-sim out of memory: tried to allocate ", nbytes,
                           " bytes on npu:", int(device), " with ", c.allocated.load(), " bytes allocated and ",
                           c.reserved.load(), " reserved of a capacity of ", c.capacity.load(),
                           " bytes (set it with torch.npu.set_memory_capacity or HAL_SIM_NPU_MEMORY)");
        }
        block = take_device_free_locked(device, size);
        if (block == nullptr) {
          bool mapped = false;
          void* ptr = resident_alloc(size, &mapped, /*huge=*/true);
          TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "npu-sim: host allocation of ", size, " bytes failed");
          block = new Block{size, device, mapped, ptr};
        }
        c.segment_count += 1;
        const auto held = static_cast<int64_t>(block->size);
        raise_peak(c.reserved_peak, c.reserved.fetch_add(held) + held);
      }
      // Counted by the block's own size, which free_block subtracts (a reused block may be up to 1/8 larger).
      const auto in_use = static_cast<int64_t>(block->size);
      raise_peak(c.peak, c.allocated.fetch_add(in_use) + in_use);
      c.alloc_count += 1;
    }
    return {block->ptr, block, &free_block, c10::Device(c10::DeviceType::PrivateUse1, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }
};

SimAllocator g_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

// Storage resize on the device (untyped_storage().resize_(n), what FSDP1 and FSDP2 do to free and re-fill a
// parameter): a new block of the sim's allocator on the storage's device, the old bytes copied over, the old
// block freed. ATen's resize_bytes_cpu is not used: for n == 0 it leaves a data pointer on the *cpu* device,
// after which set_() refuses the storage and a copy reads a null pointer.
void resize_storage_bytes(c10::StorageImpl* storage, size_t newsize) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  const c10::Device device = storage->device().type() == c10::DeviceType::PrivateUse1
                                 ? storage->device()
                                 : c10::Device(c10::DeviceType::PrivateUse1, t_current_device);
  c10::DeviceGuard guard(device);
  c10::DataPtr fresh = g_allocator.allocate(newsize);
  const size_t keep = std::min(storage->nbytes(), newsize);
  if (keep > 0 && storage->data() != nullptr) std::memcpy(fresh.get(), storage->data(), keep);
  c10::DataPtr old = storage->set_data_ptr(std::move(fresh));  // freed (back to the cache) on return
  storage->set_nbytes(newsize);
}

// ---------------------------------------------------------------- pinned host memory
std::mutex g_pinned_mutex;
std::map<uintptr_t, size_t> g_pinned;  // start -> nbytes
std::atomic<int64_t> g_pinned_bytes{0};

void free_pinned(void* ptr) {
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    auto it = g_pinned.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != g_pinned.end()) {
      size = it->second;
      g_pinned_bytes -= static_cast<int64_t>(it->second);
      g_pinned.erase(it);
    }
  }
  resident_free(ptr, size, size >= kMapThreshold);
}

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    size_t rounded = std::max<size_t>(kAlignment, ((nbytes + kAlignment - 1) / kAlignment) * kAlignment);
    bool mapped = false;
    void* ptr = resident_alloc(rounded, &mapped);  // page-locked memory is resident once allocated
    TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "npu-sim: pinned host malloc of ", nbytes, " bytes failed");
    {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned[reinterpret_cast<uintptr_t>(ptr)] = rounded;
      g_pinned_bytes += static_cast<int64_t>(rounded);
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }
};

PinnedAllocator g_pinned_allocator;

bool is_pinned_ptr(const void* data) {
  auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return false;
  --it;
  return p >= it->first && p < it->first + it->second;
}

// ---------------------------------------------------------------- device guard
struct SimGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(kType, t_current_device);
    if (d.index() >= 0) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, t_current_device); }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < g_device_count) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    auto index = stream_slot(d.index());
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index), t_current_stream[index]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    static std::atomic<int64_t> next_id{1};
    return c10::Stream(c10::Stream::UNSAFE, d, next_id++);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    auto index = stream_slot(s.device_index());
    auto old = c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index), t_current_stream[index]);
    t_current_stream[index] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(g_device_count); }
  // Every operator runs synchronously on the host, so an event is complete as soon as it is recorded.
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    static int marker = 0;
    *event = &marker;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuardImpl);

// ---------------------------------------------------------------- hooks
struct SimHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(g_device_count); }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    t_current_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return t_current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = t_current_device;
    if (d >= 0) setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  // Operators fall back to the cpu, which draws from the host generator; npu seeding seeds that one.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::make_generator<at::CPUGeneratorImpl>();
  }
  at::Device getDeviceFromPtr(void*) const override {
    return at::Device(c10::DeviceType::PrivateUse1, t_current_device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

// ---------------------------------------------------------------- kernels
c10::DispatchKeySet sim_keys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

c10::Device device_or_current(std::optional<c10::Device> device) {
  if (device.has_value() && device->index() >= 0) return *device;
  return c10::Device(c10::DeviceType::PrivateUse1, t_current_device);
}

at::Tensor sim_empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                   std::optional<at::Layout>, std::optional<at::Device> device,
                                   std::optional<bool>, std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(device_or_current(device));
  return at::detail::empty_generic(size, &g_allocator, sim_keys(), c10::dtype_or_default(dtype), memory_format);
}

at::Tensor sim_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::DeviceGuard guard(device_or_current(device));
  return at::detail::empty_strided_generic(size, stride, &g_allocator, sim_keys(), c10::dtype_or_default(dtype));
}

// A cpu tensor aliasing the same bytes (npu memory is host memory underneath), for copies.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() == c10::DeviceType::CPU) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

at::Tensor sim_copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking: copies are synchronous*/) {
  TORCH_CHECK(self.is_cpu() || self.device().is_privateuseone(), "npu-sim: cannot copy from ", self.device());
  TORCH_CHECK(dst.is_cpu() || dst.device().is_privateuseone(), "npu-sim: cannot copy to ", dst.device());
  if (dst.numel() == 0) return dst;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor sim_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  // ATen's resize_ allocates through the storage's allocator, which takes the *current* device: guard dst's own
  // (else dst on npu:1 got a block of npu:0, counted there, and its views said npu:0).
  c10::DeviceGuard guard(dst.device());
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return sim_copy_from(self, dst, false);
}

const at::Tensor& sim_resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                              std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  auto* impl = self.unsafeGetTensorImpl();
  auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  impl->set_sizes_contiguous(sizes);
  auto nbytes = at::detail::computeStorageNbytesContiguous(sizes, impl->dtype().itemsize(), impl->storage_offset());
  if (impl->numel() > 0 && nbytes > impl->storage().nbytes()) {
    resize_storage_bytes(impl->storage().unsafeGetStorageImpl(), nbytes);
  }
  if (memory_format.has_value()) {
    auto fmt = *memory_format;
    TORCH_CHECK(fmt != at::MemoryFormat::Preserve, "npu-sim: resize_ does not take MemoryFormat::Preserve");
    impl->empty_tensor_restride(fmt);
  }
  return self;
}

at::Tensor& sim_set_source_storage(at::Tensor& self, c10::Storage src) {
  int64_t new_size = static_cast<int64_t>(src.nbytes() / self.dtype().itemsize());
  return self.set_(src, 0, {new_size}, {});
}

at::Tensor& sim_set_source_storage_offset(at::Tensor& self, c10::Storage storage, c10::SymInt offset,
                                          c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, storage, offset.guard_int(__FILE__, __LINE__),
                                      C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

// set_(source): ATen's own kernel, which re-points ``self`` at ``source``'s storage through set_.source_Storage_
// storage_offset below. Without it the cpu fallback copied ``self`` to the host first, reading the bytes of a
// storage FSDP had just resized to 0 (a segfault), and then copied the result back instead of sharing storage.
at::Tensor& sim_set_source_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }

// set_(): an empty storage of the sim's own allocator on ``self``'s device (ATen's set_cpu_ would take the host's).
at::Tensor& sim_set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &g_allocator, /*resizable=*/true);
  return self.set_(storage, 0, {0}, {});
}

// Whether both tensors view the same storage with the same offset, sizes and strides; never copies.
bool sim_is_set_to(const at::Tensor& self, const at::Tensor& tensor) { return at::native::is_set_to(self, tensor); }

at::Tensor sim_view(const at::Tensor& self, c10::SymIntArrayRef size) { return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size)); }

at::Tensor sim_as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                          std::optional<c10::SymInt> offset) {
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                                           offset.has_value() ? std::optional<int64_t>(offset->guard_int(__FILE__, __LINE__))
                                                              : std::nullopt);
}

at::Tensor sim_reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

bool sim_has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto ok = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.is_cpu() || t.device().is_privateuseone());
  };
  return ok(self) && ok(from);
}

void sim_record_stream(at::Tensor&, c10::Stream) {}

// ---------------------------------------------------------------- the fallback: cpu kernels on the same bytes
// Every operator without an npu kernel runs its cpu kernel. npu memory is host memory, so the kernel runs on
// cpu *views* of the npu tensors' own bytes: no host mirror of the inputs is made (at::native::cpu_fallback
// copies every input to the host and every mutated argument back; for an optimizer step that is several
// copies of the largest parameter at once, and of the embedding for every lookup), and in-place and out=
// operators write the npu bytes directly. A view's storage is resizable through the cpu allocator: a kernel
// that resizes an out= argument gets new host memory, which is then copied back into the npu tensor.
// Fresh results are copied onto the device (counted by the allocator), as a device kernel would have
// allocated them. HAL_SIM_COPY_FALLBACK=1 switches back to at::native::cpu_fallback.
at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_privateuseone()) return t;
  const c10::Storage& src = t.storage();
  c10::Storage storage(c10::Storage::use_byte_size_t(), src.nbytes(),
                       c10::DataPtr(src.mutable_data(), nullptr, &free_nothing, c10::Device(c10::kCPU)),
                       c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor view = at::empty({0}, t.options().device(c10::kCPU));
  view.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(storage));
  view.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return view;
}

struct Swapped {
  at::Tensor original;  // the npu tensor
  at::Tensor view;      // its host view, given to the cpu kernel
  const void* data;     // the view's data pointer before the call
};

// Copy a mutated argument back unless the kernel wrote the npu bytes in place (same pointer and sizes).
void write_back(const Swapped& s) {
  if (s.view.data_ptr() == s.data && s.view.sizes() == s.original.sizes() && s.view.strides() == s.original.strides()) {
    return;
  }
  c10::DeviceGuard guard(s.original.device());  // a new block on the tensor's own device (see sim_copy_from_and_resize)
  at::native::resize_(s.original, s.view.sizes(), std::nullopt);
  sim_copy_from(s.view, s.original, false);
}

at::Tensor to_device(const at::Tensor& t, c10::Device device) {
  if (!t.defined() || !t.is_cpu()) return t;
  c10::DeviceGuard guard(device);
  at::Tensor out = at::detail::empty_strided_generic(t.sizes(), t.strides(), &g_allocator, sim_keys(),
                                                     t.scalar_type());
  sim_copy_from(t, out, false);
  return out;
}

// ---------------------------------------------------------------- one device per operator
// A device kernel reads its operands in that device's memory, so torch_npu (like CUDA) refuses an operator
// whose tensors sit on two devices; the sim's memory is all host memory, and the cpu kernel the fallback
// runs would compute across devices without a word, hiding exactly the bug (a model on npu:1, its input on
// npu:0) that real hardware reports. So the fallback refuses first, in torch's own words:
//   * pointwise operators (TensorIterator on CUDA): "Expected all tensors to be on the same device, but found
//     at least two devices, npu:0 and npu:1!";
//   * the others (the device check of torch's generated wrappers, aten/src/ATen/core/adaption.cpp):
//     "Expected all tensors to be on the same device, but got mat1 is on npu:0, different from other tensors on
//     npu:1 (when checking argument in method wrapper__addmm)"; the wrapper is named as torch's codegen names
//     it (wrapper_<dispatch key>_<overload>_<op>), with the empty key torch_npu's messages show.
// Inputs are checked in schema order, then out= arguments (which a composite kernel allocates on its first
// input's device). cpu tensors are not counted: a 0-dim cpu scalar may join a device operator, as torch
// allows. Copies between devices never come here (_copy_from and _copy_from_and_resize have kernels above).
std::string wrapper_name(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  const auto colons = name.find("::");
  if (colons != std::string::npos) name = name.substr(colons + 2);
  const auto& args = schema.arguments();
  const bool out = std::any_of(args.begin(), args.end(), [](const c10::Argument& a) { return a.is_out(); });
  if (out && (name.size() < 4 || name.compare(name.size() - 4, 4, "_out") != 0)) name += "_out";
  return "wrapper_" + schema.overload_name() + "_" + name;
}

void check_one_device(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t base) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  std::optional<c10::Device> common;
  auto visit = [&](const at::Tensor& t, const c10::Argument& arg) {
    if (!t.defined() || !t.device().is_privateuseone()) return;
    if (!common.has_value()) {
      common = t.device();
      return;
    }
    if (t.device() == *common) return;
    if (op.hasTag(at::Tag::pointwise)) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", *common,
                  " and ", t.device(), "!");
    }
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but got ", arg.name(), " is on ", t.device(),
                ", different from other tensors on ", *common, " (when checking argument in method ",
                wrapper_name(schema), ")");
  };
  for (const bool outs : {false, true}) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].is_out() != outs) continue;
      const c10::IValue& iv = stack[base + i];
      if (iv.isTensor()) {
        visit(iv.toTensor(), args[i]);
      } else if (iv.isTensorList()) {
        for (const at::Tensor& t : iv.toTensorList()) visit(t, args[i]);
      } else if (iv.isOptionalTensorList()) {
        for (std::optional<at::Tensor> t : iv.toOptionalTensorList()) {
          if (t.has_value()) visit(*t, args[i]);
        }
      }
    }
  }
}

void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  check_one_device(op, *stack, base);
  static const bool copy_fallback = std::getenv("HAL_SIM_COPY_FALLBACK") != nullptr;
  if (copy_fallback) {
    at::native::cpu_fallback(op, stack);
    return;
  }
  c10::Device device(c10::DeviceType::PrivateUse1, t_current_device);
  bool found_device = false;
  std::vector<std::vector<Swapped>> swapped(n);  // per argument: its npu tensors (one, or a list's)
  auto swap = [&](const at::Tensor& t, size_t arg) -> at::Tensor {
    if (!t.defined() || !t.device().is_privateuseone()) return t;
    if (!found_device) device = t.device(), found_device = true;
    at::Tensor view = host_view(t);
    swapped[arg].push_back({t, view, view.defined() && view.numel() > 0 ? view.data_ptr() : nullptr});
    return view;
  };
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& iv = (*stack)[base + i];
    if (iv.isTensor()) {
      iv = swap(iv.toTensor(), i);
    } else if (iv.isTensorList()) {
      c10::List<at::Tensor> list = iv.toTensorList();
      c10::List<at::Tensor> views;
      views.reserve(list.size());
      for (const at::Tensor& t : list) views.push_back(swap(t, i));
      iv = views;
    } else if (iv.isOptionalTensorList()) {
      auto list = iv.toOptionalTensorList();
      c10::List<std::optional<at::Tensor>> views;
      views.reserve(list.size());
      for (std::optional<at::Tensor> t : list) views.push_back(t.has_value() ? std::optional<at::Tensor>(swap(*t, i)) : t);
      iv = views;
    } else if (iv.isDevice() && iv.toDevice().is_privateuseone()) {
      if (!found_device) device = iv.toDevice(), found_device = true;
      iv = c10::Device(c10::kCPU);
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  // Mutated arguments: written in place, or copied back if the kernel gave them new memory.
  for (size_t i = 0; i < n; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      for (const Swapped& s : swapped[i]) write_back(s);
    }
  }
  // Results: an alias of an argument is that (npu) argument or an npu view of it; anything else is fresh.
  const size_t r = schema.returns().size();
  const size_t rbase = stack->size() - r;
  for (size_t j = 0; j < r; ++j) {
    c10::IValue& iv = (*stack)[rbase + j];
    const auto* ret_alias = schema.returns()[j].alias_info();
    if (ret_alias != nullptr && iv.isTensor()) {
      bool mapped = false;
      for (size_t i = 0; i < n && !mapped; ++i) {
        const auto* arg_alias = schema.arguments()[i].alias_info();
        if (arg_alias == nullptr || arg_alias->beforeSets() != ret_alias->beforeSets() || swapped[i].size() != 1) continue;
        const Swapped& s = swapped[i].front();
        const at::Tensor& ret = iv.toTensor();
        if (ret.is_same(s.view) || arg_alias->isWrite()) {
          iv = s.original;
        } else {  // a view of the argument: the same view of the npu tensor
          const auto offset = ret.storage_offset();
          iv = s.original.as_strided(ret.sizes(), ret.strides(), offset);
        }
        mapped = true;
      }
      if (mapped) continue;
    }
    if (iv.isTensor()) {
      iv = to_device(iv.toTensor(), device);
    } else if (iv.isTensorList()) {
      c10::List<at::Tensor> list = iv.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(list.size());
      for (const at::Tensor& t : list) out.push_back(to_device(t, device));
      iv = out;
    }
  }
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", sim_empty_memory_format);
  m.impl("empty_strided", sim_empty_strided);
  m.impl("_copy_from", sim_copy_from);
  m.impl("_copy_from_and_resize", sim_copy_from_and_resize);
  m.impl("resize_", sim_resize_);
  m.impl("set_.source_Storage", sim_set_source_storage);
  m.impl("set_.source_Storage_storage_offset", sim_set_source_storage_offset);
  m.impl("set_.source_Tensor", sim_set_source_tensor);
  m.impl("set_", sim_set_empty);
  m.impl("is_set_to", sim_is_set_to);
  m.impl("view", sim_view);
  m.impl("as_strided", sim_as_strided);
  m.impl("_reshape_alias", sim_reshape_alias);
  m.impl("_has_compatible_shallow_copy_type", sim_has_compatible_shallow_copy_type);
  m.impl("record_stream", sim_record_stream);
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  // `param.data = t` across cpu and npu dispatches here first (the op is CompositeImplicitAutograd).
  m.impl("_has_compatible_shallow_copy_type", sim_has_compatible_shallow_copy_type);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&sim_fallback>()); }

// torch.autocast("npu"): matmul-like ops run in the autocast dtype, float32-sensitive ones in float32
// (the lists CUDA uses); every other op falls through unchanged.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

#define SIM_AUTOCAST_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define SIM_AUTOCAST_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define SIM_AUTOCAST_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(SIM_AUTOCAST_LOWER)
  AT_FORALL_FP32(SIM_AUTOCAST_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(SIM_AUTOCAST_FP32_OPT)
}

// AutogradPrivateUse1 falls through to the autograd kernels like any other backend.

// ---------------------------------------------------------------- Python bindings
void init(int64_t device_count) {
  TORCH_CHECK_VALUE(device_count >= 1 && device_count <= kMaxDevices, "npu-sim: device count must be in [1, ",
                    kMaxDevices, "], got ", device_count);
  g_device_count = static_cast<int>(device_count);
  static bool hooks_registered = false;
  if (!hooks_registered) {
    at::RegisterPrivateUse1HooksInterface(new SimHooks());
    hooks_registered = true;
  }
}

DeviceCounters& counters(int64_t index) {
  check_index(index);
  return g_counters[index];
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hal npu-sim: a PrivateUse1 device with counted host memory";
  m.def("init", &init, "set the device count and register the hooks (idempotent)");
  m.def("device_count", []() { return g_device_count; });
  m.def("current_device", []() { return static_cast<int64_t>(t_current_device); });
  m.def("set_device", [](int64_t index) {
    check_index(index);
    t_current_device = static_cast<c10::DeviceIndex>(index);
  });
  m.def("memory_allocated", [](int64_t i) { return counters(i).allocated.load(); });
  m.def("max_memory_allocated", [](int64_t i) { return counters(i).peak.load(); });
  m.def("memory_reserved", [](int64_t i) { return counters(i).reserved.load(); });
  m.def("max_memory_reserved", [](int64_t i) { return counters(i).reserved_peak.load(); });
  m.def("reset_peak_memory_stats", [](int64_t i) {
    auto& c = counters(i);
    c.peak = c.allocated.load();
    c.reserved_peak = c.reserved.load();
  });
  m.def("empty_cache", [](int64_t i) {
    check_index(i);
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    release_cached_locked(static_cast<c10::DeviceIndex>(i));
  }, "return the cached (free) blocks of device i to the host");
  m.def("segment_counts", [](int64_t i) {
    auto& c = counters(i);
    return std::make_tuple(c.segment_count.load(), c.release_count.load(), c.retries.load(), c.ooms.load());
  });
  m.def("cache_residency", [](int64_t i) {
    check_index(i);
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    auto& c = counters(i);
    return std::make_tuple(g_cached_resident[i], c.dropped_bytes.load(), c.repopulated_bytes.load());
  }, "(resident bytes of blocks not in use, bytes given back so far, bytes made resident again so far) of device i");
  m.def("capacity", [](int64_t i) { return counters(i).capacity.load(); });
  m.def("set_capacity", [](int64_t i, int64_t nbytes) {
    TORCH_CHECK_VALUE(nbytes > 0, "npu-sim: capacity must be a positive number of bytes, got ", nbytes);
    counters(i).capacity = nbytes;
  });
  m.def("alloc_counts", [](int64_t i) {
    auto& c = counters(i);
    return std::make_pair(c.alloc_count.load(), c.free_count.load());
  });
  m.def("pinned_bytes", []() { return g_pinned_bytes.load(); });
  // A cpu tensor over the same bytes as an npu tensor (keeps its storage alive): collectives run gloo on it.
  m.def("host_alias", [](const at::Tensor& t) {
    if (t.is_cpu()) return t;
    TORCH_CHECK_VALUE(t.device().is_privateuseone(), "npu-sim host_alias: expected an npu or cpu tensor, got ",
                      t.device());
    at::Tensor keep = t;
    return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [keep](void*) {}, t.options().device(c10::kCPU));
  });
  // An npu tensor of device `index` over the bytes of a cpu tensor (keeps it alive): the simulated IPC maps a
  // shared-memory segment in each process and views it as device memory, as an IPC handle opens the
  // sender's device memory on real hardware (devices/npu_sim/ipc.py). Not counted by the allocator.
  m.def("device_alias", [](const at::Tensor& t, int64_t index) {
    TORCH_CHECK_VALUE(t.is_cpu(), "npu-sim device_alias: expected a cpu tensor, got ", t.device());
    check_index(index);
    at::Tensor keep = t;
    // from_blob asks the hooks which device the pointer is on (the current one): make that `index`
    const c10::DeviceIndex previous = t_current_device;
    t_current_device = static_cast<c10::DeviceIndex>(index);
    at::Tensor out = at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [keep](void*) {},
                                   t.options().device(c10::Device(c10::DeviceType::PrivateUse1, t_current_device)));
    t_current_device = previous;
    return out;
  });
}
