#pragma once
// A model whose gradients DDP may lay out (bind_gradients, core/gradient_memory.hpp): the flat
// model of tests/models.hpp, built with a gap after each gradient, so that without DDP's layout
// every gradient would be a bucket of its own under gradient_as_bucket_view.

#include "models.hpp"

#include <dparallel/core/gradient_memory.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

namespace test {

struct bindable_model : flat_model {
  explicit bindable_model(std::vector<std::size_t> s = {3, 5, 1, 8, 2, 4}, std::uint64_t seed = 1)
      : flat_model(std::move(s), seed, /*with_gap=*/true) {}

  int binds = 0;          ///< how many times bind_gradients was called
  bool ignore = false;    ///< a faulty model: it keeps its old gradients
  bool refuse = false;    ///< a model that throws instead
  bool laid_out = false;  ///< the places given were back to back in parameter order, F32, of the right sizes

  void bind_gradients(dparallel::gradient_memory const& m) {
    ++binds;
    if (refuse) throw std::invalid_argument("bindable_model: refusing the memory");
    if (ignore) return;
    auto* const base = static_cast<float*>(m.places.at(0).data());
    gap = false;  // from now on: back to back (start(p, true) without gaps)
    laid_out = m.places.size() == sizes.size();
    for (std::size_t p = 0; laid_out && p < sizes.size(); ++p)
      laid_out = m.places[p].data() == base + start(p, true) && m.places[p].size() == sizes[p] &&
                 m.places[p].dtype() == dparallel::dtype::f32;
    g.assign(dim, 0.0f);  // its size is what a copy reads from gdata
    placed = m.owner;
    gdata = base;
  }
};

}  // namespace test
