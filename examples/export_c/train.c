/* Train an exported opgrad model from C: no Python at run time.
 *
 *   train DIR STEPS STEPS_PER_CALL [LR]
 *
 * reads DIR/opgrad_init.npz (the initial weights `opgrad export` wrote), DIR/images.bin (float32,
 * [STEPS * OPGRAD_BATCH_SIZE][OPGRAD_INPUT_SIZE]) and DIR/labels.bin (int64, [STEPS *
 * OPGRAD_BATCH_SIZE]), both written by make_data.py; runs STEPS Adam steps, STEPS_PER_CALL per
 * call of opgrad_train_steps; prints one "step I loss L" line per step (L with 9 significant
 * digits: every float32 bit); then the accuracy on the first OPGRAD_EVAL_BATCH_SIZE digits and
 * the time per step (wall clock, and CPU time summed over threads), and saves DIR/trained.npz, an
 * opgrad checkpoint.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "opgrad.h"

static void *read_file(const char *dir, const char *name, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "train: cannot open %s\n", path);
        return NULL;
    }
    void *data = malloc(bytes ? bytes : 1);
    size_t got = data ? fread(data, 1, bytes, f) : 0;
    fclose(f);
    if (got != bytes) {
        fprintf(stderr, "train: %s holds fewer than the %zu bytes expected\n", path, bytes);
        free(data);
        return NULL;
    }
    return data;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s DIR STEPS STEPS_PER_CALL [LR]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    long steps = atol(argv[2]), per_call = atol(argv[3]);
    float lr = argc > 4 ? (float)atof(argv[4]) : 1e-3f;
    if (steps < 1 || per_call < 1) {
        fprintf(stderr, "train: STEPS and STEPS_PER_CALL must be >= 1\n");
        return 2;
    }
    const size_t b = OPGRAD_BATCH_SIZE, n = (size_t)steps * b;
    float *images = read_file(dir, "images.bin", n * OPGRAD_INPUT_SIZE * sizeof(float));
    int64_t *labels = read_file(dir, "labels.bin", n * sizeof(int64_t));
    float *losses = malloc((size_t)steps * sizeof(float));
    float *lrs = malloc((size_t)per_call * sizeof(float));
    if (!images || !labels || !losses || !lrs) return 1;
    for (long i = 0; i < per_call; i++) lrs[i] = lr;

    opgrad_model *model = opgrad_model_create();
    if (!model) {
        fprintf(stderr, "train: out of memory\n");
        return 1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/opgrad_init.npz", dir);
    if (opgrad_model_load(model, path) != OPGRAD_OK) {
        fprintf(stderr, "train: %s\n", opgrad_last_error(model));
        return 1;
    }
    double t0 = seconds();
    clock_t c0 = clock();
    for (long done = 0; done < steps; done += per_call) {
        long k = steps - done < per_call ? steps - done : per_call;
        int rc = opgrad_train_steps(model, k, images + (size_t)done * b * OPGRAD_INPUT_SIZE, labels + (size_t)done * b,
                                    lrs, losses + done, OPGRAD_STOP_ON_NAN);
        if (rc != OPGRAD_OK) {
            fprintf(stderr, "train: %s\n", opgrad_last_error(model));
            return 1;
        }
    }
    double elapsed = seconds() - t0, cpu = (double)(clock() - c0) / CLOCKS_PER_SEC;
    for (long i = 0; i < steps; i++) printf("step %ld loss %.9g\n", i, losses[i]);

    float logits[OPGRAD_EVAL_BATCH_SIZE * OPGRAD_NUM_CLASSES];
    int correct = 0, shown = OPGRAD_EVAL_BATCH_SIZE <= (int)n ? OPGRAD_EVAL_BATCH_SIZE : (int)n;
    if (shown == OPGRAD_EVAL_BATCH_SIZE && opgrad_eval(model, images, logits) == OPGRAD_OK) {
        for (int i = 0; i < shown; i++) {
            int best = 0;
            for (int c = 1; c < OPGRAD_NUM_CLASSES; c++)
                if (logits[i * OPGRAD_NUM_CLASSES + c] > logits[i * OPGRAD_NUM_CLASSES + best]) best = c;
            correct += best == labels[i];
        }
        printf("accuracy on the first %d training digits: %d/%d\n", shown, correct, shown);
    }
    printf("%.3f ms/step over %ld steps (%ld per call; CPU time of all threads %.3f ms/step)\n",
           1e3 * elapsed / (double)steps, steps, per_call, 1e3 * cpu / (double)steps);
    snprintf(path, sizeof path, "%s/trained.npz", dir);
    if (opgrad_model_save(model, path) != OPGRAD_OK) {
        fprintf(stderr, "train: %s\n", opgrad_last_error(model));
        return 1;
    }
    printf("saved %s (step %lld)\n", path, (long long)opgrad_model_step(model));
    opgrad_model_free(model);
    free(images);
    free(labels);
    free(losses);
    free(lrs);
    return 0;
}
