# A/B of two builds of kernels/cpu_qgemm.c's AVX2 variant in one process (alternating, minima of 15 rounds,
# outputs compared bit for bit). Run from the repo root: bash bench-results/logs/qgemm-ab/run.sh
# exp.c: a copy of kernels/cpu_qgemm.c to edit (made here when absent).
set -e
d=$(mktemp -d)
exp=bench-results/logs/qgemm-ab/exp.c
[ -f "$exp" ] || cp kernels/cpu_qgemm.c "$exp"
F="-O3 -fPIC -fopenmp -ffp-contract=off -DQG_AVX2 -mavx2 -mfma -mf16c -Ikernels"
gcc $F -DQG_NAME=base -c kernels/cpu_qgemm.c -o $d/base.o
gcc $F -DQG_NAME=exp -c "$exp" -o $d/exp.o
gcc $F bench-results/logs/qgemm-ab/main.c $d/base.o $d/exp.o -o $d/ab -lm
for a in "1 3072 576" "1 576 1536" "8 49152 576"; do OMP_WAIT_POLICY=PASSIVE $d/ab $a ${THREADS:-1}; done
