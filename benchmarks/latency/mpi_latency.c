/* The loop of core_latency.cpp over MPI_Allreduce (float32 sum, in place):
 * Open MPI's shared-memory transport without mpi4py's per-call cost.
 *
 *   mpirun -n RANKS mpi_latency SIZE_BYTES...   (rank 0 prints size -> us)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int iterations_for(size_t bytes) {
  size_t n = ((size_t)64 << 20) / (8 * bytes + 4096);
  return (int)(n < 200 ? 200 : n > 20000 ? 20000 : n);
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) printf("{");
  for (int a = 1; a < argc; ++a) {
    const size_t bytes = strtoull(argv[a], NULL, 10);
    const size_t count = bytes / 4 ? bytes / 4 : 1;
    float* v = calloc(count, sizeof(float)); /* zeros: exact and finite */
    const int iters = iterations_for(bytes);
    for (int i = 0; i < (iters / 8 > 200 ? iters / 8 : 200); ++i)
      MPI_Allreduce(MPI_IN_PLACE, v, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double rounds[5];
    for (int r = 0; r < 5; ++r) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      for (int i = 0; i < iters; ++i)
        MPI_Allreduce(MPI_IN_PLACE, v, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      MPI_Barrier(MPI_COMM_WORLD);
      rounds[r] = (MPI_Wtime() - t0) / iters * 1e6;
    }
    qsort(rounds, 5, sizeof(double), cmp);
    if (rank == 0) printf("%s\"%zu\": %f", a > 1 ? ", " : "", bytes, rounds[2]);
    free(v);
  }
  if (rank == 0) printf("}\n");
  MPI_Finalize();
  return 0;
}
