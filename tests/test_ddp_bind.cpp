// DDP lays out the gradients of a model that accepts memory for them (bind_gradients,
// core/gradient_memory.hpp), as PyTorch's gradient_as_bucket_view makes param.grad views of its
// buckets: with the option on, they move at construction into one block from the process group,
// back to back in parameter order, values kept; training then gives bitwise the copying mode's
// results and the buckets of one flat gradient buffer. Without the option, or for a model
// without bind_gradients, nothing moves; a model that does not use the memory it is given fails
// construction on every rank, saying why. (Over processes, where the block is group memory:
// test_shm_memory.)
#include "bind_models.hpp"
#include "models.hpp"

#include <dparallel/core/gradient_memory.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace dpl = dparallel;

namespace {

using test::bindable_model;
using test::flat_model;

/// DDP's options: default buckets, or buckets of a few elements (`many`).
dpl::options ddp_options(bool view, bool many) {
  dpl::options o;
  if (many) {
    o.bucket_cap_mb = 24.0 / (1024 * 1024);
    o.first_bucket_cap_mb = 8.0 / (1024 * 1024);
  }
  o.gradient_as_bucket_view = view;
  return o;
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// What one rank saw: its gradients after every synchronised step, its final parameters, and
/// what the wrapper and the model said of the layout.
struct trace {
  std::vector<std::vector<float>> grads;
  std::vector<float> params;
  std::vector<std::vector<std::size_t>> buckets;  // each bucket's parameters, in launch order
  bool bound = false;
  int binds = 0;
  bool laid_out = false;
  bool values_kept = false;
};

/// Three synchronised steps (grad_ready in reverse order), two no_sync micro-steps, one more
/// synchronised step, SGD after each synchronised one. The gradients hold 0.5 * i (element i in
/// parameter order) when the wrapper is built: a moved gradient must keep them.
template <class Model>
std::vector<trace> train(int world, dpl::options opts) {
  std::vector<trace> out(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    Model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(3 + rank.rank()));
    std::size_t k = 0;
    for (auto const& g : m.gradients())
      for (float& x : g) x = 0.5f * static_cast<float>(k++);
    dpl::distributed_data_parallel<Model> ddp(m, rank.group(), opts);
    auto& mine = out[static_cast<std::size_t>(rank.rank())];
    k = 0;
    mine.values_kept = true;
    for (auto const& g : m.gradients())
      for (float x : g) mine.values_kept = mine.values_kept && x == 0.5f * static_cast<float>(k++);
    mine.bound = ddp.reducer().gradients_bound();
    for (auto const& b : ddp.reducer().buckets()) mine.buckets.push_back(b.params);
    if constexpr (dpl::binds_gradients<Model>) {
      mine.binds = m.binds;
      mine.laid_out = m.laid_out;
    }
    auto fn = [](Model& r, test::samples<float> s, dpl::step_context& ctx) { return r.forward_backward(s, &ctx); };
    for (int step = 0; step < 6; ++step) {
      auto const data = test::dataset<float>::make(5 * static_cast<std::size_t>(world), m.dim,
                                                   static_cast<std::uint64_t>(40 + step), false);
      auto const first = static_cast<std::size_t>(rank.rank()) * 5;
      auto const shard = dpl::slice_batch(data.all(), first, first + 5);
      if (step == 3 || step == 4) {
        auto scope = ddp.no_sync();
        ddp.step(shard, fn);
        continue;
      }
      ddp.step(shard, fn);
      mine.grads.push_back(m.flat_grads());
      m.sgd(0.05f);
    }
    mine.params = m.w;
  });
  return out;
}

/// A model of three F32 parameters and an empty one whose gradients DDP lays out through
/// model_traits (a type its user cannot edit); the empty gradient is a null view.
struct sealed {
  std::array<float, 6> w{1, 2, 3, 4, 5, 6};
  std::array<float, 6> own{};
  float* g = own.data();
  std::shared_ptr<std::byte> memory;
};

}  // namespace

template <>
struct dparallel::model_traits<sealed> {
  static std::array<tensor_view<float>, 4> parameters(sealed& m) {
    return {tensor_view<float>(m.w.data(), 1), tensor_view<float>(m.w.data() + 1, 2),
            tensor_view<float>(m.w.data() + 3, 3), tensor_view<float>(nullptr, 0)};
  }
  static std::array<tensor_view<float>, 4> gradients(sealed& m) {
    return {tensor_view<float>(m.g, 1), tensor_view<float>(m.g + 1, 2), tensor_view<float>(m.g + 3, 3),
            tensor_view<float>(nullptr, 0)};
  }
  static void bind_gradients(sealed& m, gradient_memory const& given) {
    m.memory = given.owner;
    m.g = static_cast<float*>(given.places[0].data());
  }
};

static_assert(dpl::binds_gradients<bindable_model>);
static_assert(dpl::binds_gradients<sealed>);
static_assert(!dpl::binds_gradients<flat_model>);

TEST_CASE("the gradient layout: back to back in parameter order, each at a multiple of its element size",
          "[ddp][bind]") {
  std::array<dpl::tensor_ref, 5> const grads{
      dpl::tensor_ref(nullptr, 3, dpl::dtype::f32), dpl::tensor_ref(nullptr, 2, dpl::dtype::f64),
      dpl::tensor_ref(nullptr, 1, dpl::dtype::f16), dpl::tensor_ref(nullptr, 0, dpl::dtype::f32),
      dpl::tensor_ref(nullptr, 3, dpl::dtype::bf16)};
  auto const layout = dpl::detail::lay_out_gradients(grads);
  CHECK(layout.offsets == std::vector<std::size_t>{0, 16, 32, 36, 36});
  CHECK(layout.bytes == 42);
  CHECK(dpl::detail::lay_out_gradients({}).bytes == 0);
}

TEST_CASE("DDP lays out a bind_gradients model's gradients and trains bitwise as the copying mode",
          "[ddp][bind][contract]") {
  for (int world = 1; world <= 3; ++world) {
    for (bool many : {false, true}) {
      INFO("world = " << world << ", many buckets = " << many);
      auto const copying = train<flat_model>(world, ddp_options(false, many));
      auto const flat_views = train<flat_model>(world, ddp_options(true, many));
      auto const bound = train<bindable_model>(world, ddp_options(true, many));
      for (int r = 0; r < world; ++r) {
        auto const& c = copying[static_cast<std::size_t>(r)];
        auto const& b = bound[static_cast<std::size_t>(r)];
        CHECK(b.binds == 1);
        CHECK(b.bound);
        CHECK(b.laid_out);
        CHECK(b.values_kept);
        CHECK_FALSE(flat_views[static_cast<std::size_t>(r)].bound);
        // The buckets of one flat gradient buffer, not one per gradient (the model's own gaps).
        CHECK(b.buckets == flat_views[static_cast<std::size_t>(r)].buckets);
        REQUIRE(c.grads.size() == b.grads.size());
        for (std::size_t k = 0; k < c.grads.size(); ++k) CHECK(same_bits(c.grads[k], b.grads[k]));
        CHECK(same_bits(c.params, b.params));
        CHECK(same_bits(b.params, bound[0].params));
      }
    }
  }
}

TEST_CASE("without gradient_as_bucket_view, or without bind_gradients, the gradients stay where they are",
          "[ddp][bind]") {
  auto const copying = train<bindable_model>(2, ddp_options(false, true));
  auto const gaps = train<flat_model>(2, ddp_options(false, true));
  for (int r = 0; r < 2; ++r) {
    auto const& c = copying[static_cast<std::size_t>(r)];
    CHECK(c.binds == 0);
    CHECK_FALSE(c.bound);
    CHECK(c.values_kept);
    CHECK(same_bits(c.params, gaps[static_cast<std::size_t>(r)].params));
  }
  // A model without bind_gradients under the option: its gapped gradients make a bucket each.
  std::vector<std::size_t> counts(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    flat_model m({3, 5, 1, 8, 2, 4}, 3, /*with_gap=*/true);
    dpl::distributed_data_parallel<flat_model> ddp(m, rank.group(), {.gradient_as_bucket_view = true});
    auto const& reducer = ddp.reducer();
    counts[static_cast<std::size_t>(rank.rank())] = reducer.gradients_bound() ? 0 : reducer.buckets().size();
  });
  CHECK(counts == std::vector<std::size_t>{6, 6});
}

TEST_CASE("model_traits<M>::bind_gradients: a type its user cannot edit is laid out too", "[ddp][bind]") {
  std::vector<int> ok(2, 0);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    sealed m;
    m.own = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f};
    dpl::distributed_data_parallel<sealed> ddp(m, rank.group(), {.gradient_as_bucket_view = true});
    bool const moved = m.g != m.own.data() && m.memory != nullptr && ddp.reducer().gradients_bound();
    bool const kept = m.g[0] == 0.5f && m.g[5] == 5.5f;
    float const weight = static_cast<float>(rank.rank() + 1);
    std::vector<float> rows(4, 1.0f);
    ddp.step(dpl::view(rows), [weight](sealed& s, auto) {
      for (std::size_t i = 0; i < 6; ++i) s.g[i] = weight * static_cast<float>(i + 1);
    });
    bool reduced = true;  // the average of ranks 0 and 1: (1 + 2) / 2 (i + 1), exact in F32
    for (std::size_t i = 0; i < 6; ++i) reduced = reduced && m.g[i] == 1.5f * static_cast<float>(i + 1);
    ok[static_cast<std::size_t>(rank.rank())] = moved && kept && reduced && ddp.reducer().buckets().size() == 1;
  });
  CHECK(ok == std::vector<int>{1, 1});
}

TEST_CASE("a model that does not use the memory bind_gradients gave it fails construction on every rank",
          "[ddp][bind]") {
  for (bool refuse : {false, true}) {  // keeps its old gradients, or throws
    INFO("refuse = " << refuse);
    std::vector<std::string> errors(2);
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      bindable_model m;
      m.ignore = !refuse && rank.rank() == 1;
      m.refuse = refuse && rank.rank() == 1;
      try {
        dpl::distributed_data_parallel<bindable_model> ddp(m, rank.group(), {.gradient_as_bucket_view = true});
      } catch (dpl::invalid_argument const& e) {
        errors[static_cast<std::size_t>(rank.rank())] = e.what();
      }
    });
    if (refuse)
      CHECK_THAT(errors[1], Catch::Contains("rank 1: the model's bind_gradients failed: bindable_model: refusing"));
    else
      CHECK_THAT(errors[1], Catch::Contains("rank 1") && Catch::Contains("bind_gradients") &&
                                Catch::Contains("expected gradients() to return the places"));
    CHECK_THAT(errors[0], Catch::Contains("rank 1 could not plan its gradient buckets"));
  }
}
