// The block cache: a CPU allocator for a process under a memory budget.
//
// Every CPU allocation of at least `min_bytes` gets its own anonymous mapping, rounded up to whole
// pages; smaller ones go to the allocator it replaces. A freed block is kept, by its exact size, in
// a cache of at most `cap_bytes` (least recently freed evicted first; a block larger than the cap
// is unmapped at once), and an allocation of that size takes it back: a forward's chunk loop
// allocates the same sizes chunk after chunk and layer after layer, so its pages are faulted in
// once per forward, not once per chunk. `release` unmaps every cached block.
//
// Why not the C library's heap: where its big blocks land depends on what ran before (glibc moves
// its mmap threshold with the sizes freed, and a heap's free holes differ from process to
// process), so a forward's resident peak measured at start-up need not hold later. Here a forward
// that starts with an empty cache makes the same mappings in the same order every time: its peak
// is that of its own allocations plus at most `cap_bytes` of cached blocks.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <cerrno>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;

struct Block {
  void* ptr;
  size_t size;
};

class BlockCache final : public c10::Allocator {
 public:
  BlockCache(c10::Allocator* small, size_t min_bytes, size_t cap_bytes)
      : small_(small), min_bytes_(min_bytes), cap_(cap_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) return small_->allocate(n);
    const size_t size = (n + kPage - 1) / kPage * kPage;
    void* p = take(size);
    if (p == nullptr) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED, "block cache: can't allocate memory: mapping ", size,
                       " bytes failed: ", std::strerror(errno));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_.emplace(p, size);
      live_bytes_ += size;
    }
    return {p, p, &free_any, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  // A pointer from raw_allocate may be ours or the smaller allocator's: the map of live blocks says which.
  static void free_any(void* p);

  bool give_back(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) return false;
    const size_t size = it->second;
    live_.erase(it);
    live_bytes_ -= size;
    if (size > cap_) {
      munmap(p, size);
      return true;
    }
    lru_.push_front(Block{p, size});
    by_size_.emplace(size, lru_.begin());
    cached_bytes_ += size;
    evict_to(cap_);
    return true;
  }

  void set_cap(size_t cap_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    cap_ = cap_bytes;
    evict_to(cap_);
  }

  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    evict_to(0);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {static_cast<int64_t>(cached_bytes_), static_cast<int64_t>(live_bytes_), hits_, misses_,
            static_cast<int64_t>(cap_)};
  }

  c10::Allocator* small() const { return small_; }

 private:
  // A cached block of exactly `size` bytes (the most recently freed), or nullptr.
  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_size_.find(size);
    if (it == by_size_.end()) {
      ++misses_;
      return nullptr;
    }
    ++hits_;
    auto node = it->second;
    void* p = node->ptr;
    by_size_.erase(it);
    lru_.erase(node);
    cached_bytes_ -= size;
    return p;
  }

  // Unmap the least recently freed blocks until at most `bytes` stay cached (mu_ held).
  void evict_to(size_t bytes) {
    while (cached_bytes_ > bytes) {
      auto node = std::prev(lru_.end());
      auto range = by_size_.equal_range(node->size);
      for (auto r = range.first; r != range.second; ++r) {
        if (r->second == node) {
          by_size_.erase(r);
          break;
        }
      }
      munmap(node->ptr, node->size);
      cached_bytes_ -= node->size;
      lru_.erase(node);
    }
  }

  c10::Allocator* const small_;
  const size_t min_bytes_;
  size_t cap_;
  std::mutex mu_;
  std::list<Block> lru_;  // front: the most recently freed
  std::unordered_multimap<size_t, std::list<Block>::iterator> by_size_;
  std::unordered_map<void*, size_t> live_;
  size_t cached_bytes_ = 0;
  size_t live_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

// Installed once and never destroyed: tensors it allocated may be freed as late as the process's exit.
BlockCache* g_cache = nullptr;
std::mutex g_install;

void BlockCache::free_any(void* p) {
  if (!g_cache->give_back(p)) g_cache->small()->raw_deleter()(p);
}

// Make the block cache the CPU allocator (or, when it already is, set its cap). False when it
// cannot be: the allocator in place frees nothing by pointer alone, or another one ranks higher.
bool install(int64_t min_bytes, int64_t cap_bytes) {
  TORCH_CHECK(min_bytes >= static_cast<int64_t>(kPage), "block cache: min_bytes must be >= ", kPage);
  TORCH_CHECK(cap_bytes >= 0, "block cache: cap_bytes must be >= 0");
  std::lock_guard<std::mutex> lock(g_install);
  if (g_cache != nullptr) {
    g_cache->set_cap(static_cast<size_t>(cap_bytes));
    return c10::GetCPUAllocator() == g_cache;
  }
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current->raw_deleter() == nullptr) return false;
  g_cache = new BlockCache(current, static_cast<size_t>(min_bytes), static_cast<size_t>(cap_bytes));
  c10::SetCPUAllocator(g_cache, /*priority=*/1);
  return c10::GetCPUAllocator() == g_cache;
}

void release() {
  if (g_cache != nullptr) g_cache->release();
}

// [cached bytes, live bytes, hits, misses, cap bytes]; empty before install.
std::vector<int64_t> stats() { return g_cache != nullptr ? g_cache->stats() : std::vector<int64_t>{}; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_native, m) {
  m.def("block_cache_install(int min_bytes, int cap_bytes) -> bool", &install);
  m.def("block_cache_release() -> ()", &release);
  m.def("block_cache_stats() -> int[]", &stats);
}
