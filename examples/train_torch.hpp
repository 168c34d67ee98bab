// The reference model as a libtorch module: 784-512-ReLU-10, shared by examples/train_torch.cpp and
// benchmarks/torch_adapter.cpp. Named as the PyTorch module `nn.Module` with fc1 / fc2 would name it,
// so its state dicts load into that module.
#pragma once

#include <torch/torch.h>

namespace example {

/// The MLP; derives from Cloneable so that DataParallel can make replicas with clone().
struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(784, 512));
    fc2 = register_module("fc2", torch::nn::Linear(512, 10));
  }
  torch::Tensor forward(torch::Tensor const& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace example
