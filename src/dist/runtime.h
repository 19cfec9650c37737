// Process start and end under mpirun/srun: MPI setup, world rank and size, the local GPU.
#pragma once
#include <string>

namespace megaton::dist {

// Whether a launcher started this process as one rank of a job: mpirun (Open MPI's
// OMPI_COMM_WORLD_SIZE), a PMI or PMIx launcher (PMI_SIZE, PMIX_RANK), or srun
// (SLURM_NTASKS with SLURM_STEP_NUM_TASKS, which only srun sets).
bool launched_by_mpi();

// Starts MPI (MPI_Init_thread, funneled: only the main thread calls MPI) when
// launched_by_mpi(); otherwise the process is a world of one and MPI is never touched.
// MPI errors on the world communicator return codes instead of aborting. In CUDA builds
// with a GPU, a launched rank uses GPU local_rank() % device count. Idempotent. Throws
// InternalError when MPI fails to start.
void init(int* argc, char*** argv);

// Whether init() started MPI and finalize() has not run.
bool mpi_active();

// This process's rank and the number of ranks in the job (0 and 1 without a launcher).
int world_rank();
int world_size();
// Rank among the job's processes on this node (OMPI_COMM_WORLD_LOCAL_RANK,
// SLURM_LOCALID, MPI_LOCALRANKID, else from MPI's shared-memory split); 0 alone.
int local_rank();

// World rank 0's `s` on every rank (MPI_Bcast over the world); `s` itself without MPI.
// For the few steps before a Trainer's groups exist (train/hf_load.h). Throws
// InternalError when MPI fails.
std::string broadcast_from_rank0(const std::string& s);

// MPI_Barrier over the world; nothing without MPI.
void world_barrier();

// MPI_Finalize when init() started MPI; idempotent. Call it on the normal exit path of
// every rank. After an error a rank exits without it: a non-zero exit makes mpirun end
// the job, where MPI_Finalize could wait forever for ranks stuck in a collective.
void finalize();

}  // namespace megaton::dist
