/* The loop of core_latency.cpp over MPI (float32; all_reduce: sum, in place;
 * all_gather: in place, SIZE the output's bytes; broadcast: from rank 0;
 * DATA static or fresh, as there): Open MPI's shared-memory transport
 * without mpi4py's per-call cost.
 *
 *   mpirun -n RANKS mpi_latency COLLECTIVE DATA SIZE_BYTES...   (size -> us)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int iterations_for(size_t bytes) {
  size_t n = ((size_t)64 << 20) / (8 * bytes + 4096);
  return (int)(n < 200 ? 200 : n > 20000 ? 20000 : n);
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static const char* g_collective;
static int g_fresh, g_rank;

/* "fresh": rewrite what this rank contributes, as core_latency.cpp does. */
static void call(float* v, size_t count, int n) {
  if (g_fresh) {
    if (strcmp(g_collective, "all_gather") == 0) {
      memset(v + count / n * g_rank, 0, count / n * sizeof(float));
    } else if (strcmp(g_collective, "all_reduce") == 0 || g_rank == 0) {
      memset(v, 0, count * sizeof(float));
    }
  }
  if (strcmp(g_collective, "all_reduce") == 0) {
    MPI_Allreduce(MPI_IN_PLACE, v, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (strcmp(g_collective, "all_gather") == 0) {
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, v, (int)(count / n), MPI_FLOAT,
                  MPI_COMM_WORLD);
  } else {
    MPI_Bcast(v, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
  }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 4 ||
      (strcmp(argv[1], "all_reduce") && strcmp(argv[1], "all_gather") &&
       strcmp(argv[1], "broadcast")) ||
      (strcmp(argv[2], "static") && strcmp(argv[2], "fresh"))) {
    if (rank == 0)
      fprintf(
          stderr,
          "usage: mpi_latency all_reduce|all_gather|broadcast static|fresh SIZE...\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_collective = argv[1];
  g_fresh = strcmp(argv[2], "fresh") == 0;
  g_rank = rank;
  if (rank == 0) printf("{");
  for (int a = 3; a < argc; ++a) {
    const size_t bytes = strtoull(argv[a], NULL, 10);
    /* whole pieces, as core_latency.cpp */
    const size_t count = ((bytes / 4 > (size_t)n ? bytes / 4 : (size_t)n) / n) * n;
    float* v = calloc(count, sizeof(float)); /* zeros: exact and finite */
    const int iters = iterations_for(bytes);
    for (int i = 0; i < (iters / 8 > 200 ? iters / 8 : 200); ++i) call(v, count, n);
    double rounds[5];
    for (int r = 0; r < 5; ++r) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      for (int i = 0; i < iters; ++i) call(v, count, n);
      MPI_Barrier(MPI_COMM_WORLD);
      rounds[r] = (MPI_Wtime() - t0) / iters * 1e6;
    }
    qsort(rounds, 5, sizeof(double), cmp);
    if (rank == 0) printf("%s\"%zu\": %f", a > 3 ? ", " : "", bytes, rounds[2]);
    free(v);
  }
  if (rank == 0) printf("}\n");
  MPI_Finalize();
  return 0;
}
