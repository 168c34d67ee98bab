#pragma once
// The NCCL engine (part of the NCCL add-on, target dparallel::nccl): nccl::communicator, the
// communicator concept over NCCL for tensors in GPU memory (comm/nccl/communicator.hpp), and the
// ways to make NCCL process groups, nccl::make_groups and nccl::init_process_group
// (comm/nccl/groups.hpp).

#include <dparallel/comm/nccl/communicator.hpp>
#include <dparallel/comm/nccl/groups.hpp>
