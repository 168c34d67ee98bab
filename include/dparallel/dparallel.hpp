#pragma once
// dparallel: DataParallel and DistributedDataParallel for C++ models.
// This umbrella header brings the core, the host backend and the wrappers; it never includes a
// CUDA, NCCL or MPI header (those come with backend/cuda, comm/nccl and comm/mpi).

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/batch.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/buffer.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/gradient_memory.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/partition.hpp>
#include <dparallel/core/step_context.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/data/distributed_sampler.hpp>
#include <dparallel/data/loader.hpp>
#include <dparallel/backend/host/backend.hpp>
#include <dparallel/policy/bucketed_reduce.hpp>
#include <dparallel/policy/compress_hooks.hpp>
#include <dparallel/policy/gather.hpp>
#include <dparallel/policy/reduce.hpp>
#include <dparallel/policy/replica_set.hpp>
#include <dparallel/policy/replicate.hpp>
#include <dparallel/policy/scatter.hpp>
#include <dparallel/parallel.hpp>
#include <dparallel/spawn.hpp>
#include <dparallel/launch.hpp>
