// train_generic: ONE training function, written once and templated on the semantics bundle, that
// trains the reference MLP (mlp.hpp) on Fashion-MNIST as DataParallel over N host devices
// (--bundle dp), as DDP over N thread ranks (--bundle ddp), or with a mixed bundle: DDP whose
// gradient reduction is a policy written in this file (--bundle mixed). The three differ by one
// `using` in main() (see run()); the step function, the data loading and the optimizer step are
// the same source.
//
// Then it trains the same model on one device, without dparallel, on the same batches in the same
// order, and compares the parameters: bitwise (--expect bitwise) or within a relative tolerance
// (--expect 1e-5). Exit status 0 when they agree, 1 when they do not, 2 for a bad command line.
//
//   train_generic --bundle ddp --devices 2 --train-samples 1024 --expect bitwise
//
// Each replica computes its shard in one pass (mlp::blocking's default); the one-device run cuts
// every batch into as many parts and sums their gradients as the bundle's reduction sums the
// shards': pairwise for DataParallel, in rank order for DDP's all-reduce over thread ranks. With 2
// or 4 replicas (power-of-two weights) the parallel gradient is then the one-device gradient to the
// bit; other counts agree within rounding.

#include "fashion_mnist.hpp"
#include "mlp.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/launch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

namespace {

// ------------------------------------------------------------------------------------------------
// A policy written from scratch (docs/writing-policies.md): DDP's reduce slot, averaging each
// gradient with one all_reduce per parameter, in parameter order, after the step function is done
// (no buckets, no overlap with backward). The communicator sums in rank order either way, so the
// result is bitwise that of dparallel::ddp's bucketed all-reduce. Like every DDP reducer it weighs
// this rank's gradient by s.join.scale first (exactly 1 unless options::uneven_inputs or
// average_mode::samples make the ranks' contributions unequal; the MLP's gradients are float).
struct per_parameter_all_reduce {
  template <dparallel::policy_set Set>
  void on_construct(Set& s) {
    if (!s.group.valid())
      throw dparallel::invalid_argument("per_parameter_all_reduce: expected a process group (use it in a DDP bundle)");
  }
  template <dparallel::policy_set Set>
  void begin_step(Set&) {}
  template <dparallel::policy_set Set>
  void grad_ready(Set&, int, std::size_t) {}
  template <dparallel::policy_set Set>
  void finish(Set& s) {
    // Runs on the replica's stream, after its step function: the gradients are final there.
    s.streams[0]->enqueue([&s] {
      if (double const scale = s.join.scale; scale != 1.0)
        for (dparallel::tensor_ref const& g : s.grads[0])
          for (float& x : g.template as<float>()) x = static_cast<float>(x * scale);
      std::vector<dparallel::work> pending;
      for (dparallel::tensor_ref const& g : s.grads[0]) pending.push_back(s.group.all_reduce(g, dparallel::reduce_op::avg));
      for (auto const& w : pending) w.wait();
    });
  }
};
static_assert(dparallel::reduce_policy<per_parameter_all_reduce>);

/// The mixed bundle: DDP with the reduce policy above.
struct ddp_per_parameter : dparallel::ddp {
  using reduce = per_parameter_all_reduce;
};

// ------------------------------------------------------------------------------------------------

struct config {
  std::string bundle = "dp";
  int devices = 2;
  int epochs = 2;
  std::size_t batch = 128;
  std::size_t train_samples = 1024;
  float lr = 0.1f;
  std::uint64_t seed = 1;
  std::string expect = "bitwise";  // or a relative tolerance
  std::string data = fashion_mnist::default_dir;
};

/// One batch's samples copied out of the dataset; view() is what the model reads.
struct gathered {
  std::vector<float> images;
  std::vector<std::int32_t> labels;
  [[nodiscard]] batch view() const {
    std::size_t const n = labels.size();
    return {dparallel::tensor_view<float const>(images.data(), n * mlp::inputs, n),
            dparallel::tensor_view<std::int32_t const>(labels.data(), n, n)};
  }
};

gathered load(fashion_mnist::dataset const& d, std::vector<std::size_t> const& indices) {
  gathered g;
  for (std::size_t i : indices) {
    auto const first = d.images.begin() + static_cast<std::ptrdiff_t>(i * mlp::inputs);
    g.images.insert(g.images.end(), first, first + static_cast<std::ptrdiff_t>(mlp::inputs));
    g.labels.push_back(d.labels[i]);
  }
  return g;
}

/// Plain SGD on the model's parameters.
void sgd(mlp& m, float lr) {
  auto params = dparallel::parameters(m);
  auto grads = dparallel::gradients(m);
  for (std::size_t p = 0; p < params.size(); ++p)
    for (std::size_t k = 0; k < params[p].size(); ++k) params[p][k] -= lr * grads[p][k];
}

std::vector<float> flat(mlp& m) {
  std::vector<float> out;
  for (auto const& t : dparallel::parameters(m)) out.insert(out.end(), t.begin(), t.end());
  return out;
}

/// THE training function: the same source for every bundle.
template <class Semantics>
std::vector<float> train(dparallel::world const& w, config const& cfg, fashion_mnist::dataset const& data) {
  std::vector<float> trained;
  dparallel::launch<Semantics>(w, [&](auto& s) {
    mlp model(cfg.seed);
    auto par = s.wrap(model);
    auto plan = s.batches(data.size(), {.global_batch = cfg.batch, .seed = cfg.seed});
    for (int epoch = 0; epoch < cfg.epochs; ++epoch) {
      plan.set_epoch(static_cast<std::uint64_t>(epoch));
      double loss = 0;
      for (std::size_t j = 0; j < plan.size(); ++j) {
        gathered const b = load(data, plan[j]);
        auto out = par.step(b.view(), [](mlp& m, batch shard) { return m.forward_backward(shard); });
        loss += dparallel::global_mean(par, out);  // over every rank's samples: DP and DDP print the same
        sgd(par.module(), cfg.lr);
      }
      if (s.is_main())
        std::printf("train_generic: epoch %d: mean loss %.4f over %zu steps\n", epoch + 1,
                    loss / static_cast<double>(plan.size()), plan.size());
    }
    if (s.is_main()) trained = flat(par.module());
  });
  return trained;
}

/// One device, no dparallel wrapper: the same batches (read as `replicas` sampler replicas), each
/// cut into `replicas` parts summed as the bundle sums the replicas' gradients.
std::vector<float> one_device(config const& cfg, fashion_mnist::dataset const& data, int replicas) {
  mlp model(cfg.seed);
  model.split = {.parts = static_cast<std::size_t>(replicas), .block = 0, .parts_in_order = cfg.bundle != "dp"};
  dparallel::batch_plan plan(data.size(), replicas, 0, replicas, {.global_batch = cfg.batch, .seed = cfg.seed});
  for (int epoch = 0; epoch < cfg.epochs; ++epoch) {
    plan.set_epoch(static_cast<std::uint64_t>(epoch));
    for (std::size_t j = 0; j < plan.size(); ++j) {
      model.forward_backward(load(data, plan[j]).view());
      sgd(model, cfg.lr);
    }
  }
  return flat(model);
}

std::vector<float> run(config const& cfg, fashion_mnist::dataset const& data) {
  auto const w = dparallel::world::local(cfg.devices);
  if (cfg.bundle == "dp") return train<dparallel::dp>(w, cfg, data);
  if (cfg.bundle == "ddp") return train<dparallel::ddp>(w, cfg, data);
  if (cfg.bundle == "mixed") return train<ddp_per_parameter>(w, cfg, data);
  throw std::invalid_argument("--bundle: expected dp, ddp or mixed, found '" + cfg.bundle + "'");
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("expected a value after " + a);
    std::string const v = argv[++i];
    if (a == "--bundle") c.bundle = v;
    else if (a == "--devices") c.devices = std::stoi(v);
    else if (a == "--epochs") c.epochs = std::stoi(v);
    else if (a == "--batch") c.batch = std::stoul(v);
    else if (a == "--train-samples") c.train_samples = std::stoul(v);
    else if (a == "--lr") c.lr = std::stof(v);
    else if (a == "--seed") c.seed = std::stoull(v);
    else if (a == "--expect") c.expect = v;
    else if (a == "--data") c.data = v;
    else throw std::invalid_argument("unknown option " + a);
  }
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  config cfg;
  try {
    cfg = parse(argc, argv);
  } catch (std::exception const& e) {
    std::fprintf(stderr,
                 "train_generic: %s\nusage: train_generic [--bundle dp|ddp|mixed] [--devices N] [--epochs E] "
                 "[--batch B] [--train-samples N] [--lr X] [--seed S] [--expect bitwise|TOL] [--data DIR]\n",
                 e.what());
    return 2;
  }
  try {
    openblas_set_num_threads(1);
    auto const data = fashion_mnist::load(cfg.data, "train", cfg.train_samples);
    std::vector<float> const got = run(cfg, data);
    std::vector<float> const want = one_device(cfg, data, cfg.devices);
    double num = 0, den = 0;
    std::size_t differ = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      double const d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
      num += d * d;
      den += static_cast<double>(want[i]) * static_cast<double>(want[i]);
      differ += got[i] != want[i] ? 1 : 0;
    }
    double const rel = std::sqrt(num / den);
    std::printf("train_generic: --bundle %s over %d: %zu of %zu parameters differ from one device's, relative "
                "error %.3g\n",
                cfg.bundle.c_str(), cfg.devices, differ, want.size(), rel);
    bool const ok = cfg.expect == "bitwise" ? differ == 0 : rel <= std::stod(cfg.expect);
    std::printf("train_generic: %s (expected %s)\n", ok ? "equal to one device" : "NOT equal to one device",
                cfg.expect.c_str());
    return ok ? 0 : 1;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "train_generic: %s\n", e.what());
    return 1;
  }
}
