/* The runtime of an exported opgrad model: memory, the thread pool behind opgrad_parallel_for,
 * the calls into the compiled step, and checkpoint (.npz) load/save.
 *
 * This file is a template. `opgrad export` prepends the model's tables (pointer-table slots,
 * arena offsets, array names and shapes, constants) and appends the entry points whose
 * signatures depend on the model (opgrad_train_step/opgrad_train_steps); it renames the
 * `opgrad_`/`OPGRAD_` prefixes when the export is given another --name. Nothing here needs Python,
 * llvmlite or raw system call numbers: C11, POSIX threads (unless OG_MAX_THREADS is 1) and libm.
 *
 * The compiled code's contract (docs/compiler.md): the entry takes a pointer table `bufs` (one
 * slot per parameter, result, intermediate and constant) and a per-thread workspace `ws`;
 * intermediates live in one arena at planned offsets; kernels split work with
 * opgrad_parallel_for(task, ctx), calling task(ctx, tid, nthreads) once per tid, and their
 * results do not depend on nthreads.
 */

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define OG_ALIGN 64
#define OG_STATUS_WORDS 5

typedef void (*og_task_fn)(void *ctx, int32_t tid, int32_t nthreads);

struct opgrad_model {
    void *train_bufs[OG_TRAIN_SLOTS];
    void *eval_bufs[OG_EVAL_SLOTS];
    unsigned char *train_arena;
    unsigned char *eval_arena;
    unsigned char *ws;
    unsigned char *banks[2]; /* two copies of every parameter and state array; the loop swaps them */
    int64_t step;
    int64_t epoch;
    char error[512];
};

static int og_fail(opgrad_model *m, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->error, sizeof m->error, fmt, ap);
    va_end(ap);
    return code;
}

static void *og_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, OG_ALIGN, bytes ? bytes : OG_ALIGN) != 0) return NULL;
    memset(p, 0, bytes ? bytes : OG_ALIGN);
    return p;
}

static size_t og_round(size_t n) { return (n + OG_ALIGN - 1) / OG_ALIGN * OG_ALIGN; }

/* ------------------------------------------------------------------------------------------ */
/* Thread pool                                                                                */
/* ------------------------------------------------------------------------------------------ */

#if OG_MAX_THREADS == 1

static int og_pool_acquire(void) { return 1; }
static void og_pool_release(void) {}
__attribute__((visibility("hidden"))) void opgrad_parallel_for(og_task_fn fn, void *ctx) { fn(ctx, 0, 1); }

#else

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define OG_POOL_LIMIT 256
#define OG_SPINS 20000 /* ~50-100 us of spinning before sleeping: keeps back-to-back kernels hot */

/* One pool per process (per export name), shared by every model and started with the first
 * one. Workers spin on a job counter for a while, then sleep on a condition variable; a job is
 * claimed share by share with a CAS on one word holding (job << 32 | next share), so a late
 * worker can never run a share of a job that has been replaced. The calling thread claims
 * shares too. When the pool is busy (a second thread calls in, or a kernel nests), the caller
 * runs all shares itself: the results are the same by the tasks' contract. */
static pthread_mutex_t og_pool_life = PTHREAD_MUTEX_INITIALIZER; /* starting and stopping */
static pthread_mutex_t og_pool_lock = PTHREAD_MUTEX_INITIALIZER; /* sleeping and waking */
static pthread_cond_t og_pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_t og_pool_threads[OG_POOL_LIMIT];
static int og_pool_started;
static int og_pool_refs;
static int og_pool_size = 1;
static atomic_uint og_seq;
static atomic_int og_stop;
static atomic_int og_done;
static atomic_int og_busy;
static atomic_int og_sleepers;
static _Atomic uint64_t og_claim;
static _Atomic(og_task_fn) og_fn;
static _Atomic(void *) og_ctx;

static inline void og_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause(); /* keeps a spinning core from starving its SMT sibling */
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void og_run_shares(unsigned job) {
    int nt = og_pool_size;
    for (;;) {
        uint64_t w = atomic_load_explicit(&og_claim, memory_order_acquire);
        uint64_t share = w & 0xffffffffu;
        if ((w >> 32) != job || share >= (uint64_t)nt) return;
        if (!atomic_compare_exchange_weak_explicit(&og_claim, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        og_task_fn fn = atomic_load_explicit(&og_fn, memory_order_acquire);
        void *ctx = atomic_load_explicit(&og_ctx, memory_order_acquire);
        fn(ctx, (int32_t)share, nt);
        atomic_fetch_add_explicit(&og_done, 1, memory_order_release);
    }
}

static void *og_worker(void *arg) {
    unsigned seen = (unsigned)(uintptr_t)arg;
    for (;;) {
        unsigned s;
        int spins = 0;
        while ((s = atomic_load_explicit(&og_seq, memory_order_acquire)) == seen && !atomic_load(&og_stop)) {
            if (++spins < OG_SPINS) {
                og_relax();
                continue;
            }
            pthread_mutex_lock(&og_pool_lock);
            atomic_fetch_add(&og_sleepers, 1);
            while (atomic_load(&og_seq) == seen && !atomic_load(&og_stop))
                pthread_cond_wait(&og_pool_wake, &og_pool_lock);
            atomic_fetch_sub(&og_sleepers, 1);
            pthread_mutex_unlock(&og_pool_lock);
            spins = 0;
        }
        if (atomic_load(&og_stop)) return NULL;
        seen = s;
        og_run_shares(s);
    }
}

static int og_pool_threads_wanted(void) {
    long n = OG_MAX_THREADS;
    const char *env = getenv(OG_THREADS_ENV);
    if (env && *env) {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (end && *end == '\0' && v >= 1) n = v;
    }
    if (n <= 0) n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > OG_POOL_LIMIT) n = OG_POOL_LIMIT;
    return (int)n;
}

/* Start the pool with the first model; returns its size (threads, the caller included). Starting
 * and stopping hold og_pool_life throughout, so a model created while the last one is being freed
 * waits for the old workers to be joined before new ones start. */
static int og_pool_acquire(void) {
    pthread_mutex_lock(&og_pool_life);
    if (og_pool_refs++ == 0) {
        int wanted = og_pool_threads_wanted();
        unsigned seq = atomic_load(&og_seq);
        atomic_store(&og_stop, 0);
        og_pool_started = 0;
        for (int t = 1; t < wanted; t++) { /* a thread that cannot start just makes the pool smaller */
            if (pthread_create(&og_pool_threads[og_pool_started], NULL, og_worker, (void *)(uintptr_t)seq) != 0)
                break;
            og_pool_started++;
        }
        og_pool_size = og_pool_started + 1;
    }
    int size = og_pool_size;
    pthread_mutex_unlock(&og_pool_life);
    return size;
}

/* Stop and join the workers with the last model, so that unloading a shared library is safe. */
static void og_pool_release(void) {
    pthread_mutex_lock(&og_pool_life);
    if (--og_pool_refs == 0) {
        pthread_mutex_lock(&og_pool_lock);
        atomic_store(&og_stop, 1);
        pthread_cond_broadcast(&og_pool_wake);
        pthread_mutex_unlock(&og_pool_lock);
        for (int t = 0; t < og_pool_started; t++) pthread_join(og_pool_threads[t], NULL);
        og_pool_started = 0;
        og_pool_size = 1;
    }
    pthread_mutex_unlock(&og_pool_life);
}

__attribute__((visibility("hidden"))) void opgrad_parallel_for(og_task_fn fn, void *ctx) {
    int nt = og_pool_size;
    int idle = 0;
    if (nt <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    if (!atomic_compare_exchange_strong(&og_busy, &idle, 1)) {
        for (int t = 0; t < nt; t++) fn(ctx, t, nt);
        return;
    }
    atomic_store_explicit(&og_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&og_ctx, ctx, memory_order_relaxed);
    atomic_store(&og_done, 0);
    unsigned job = atomic_load(&og_seq) + 1;
    atomic_store(&og_claim, (uint64_t)job << 32);
    atomic_store(&og_seq, job);
    if (atomic_load(&og_sleepers) > 0) {
        pthread_mutex_lock(&og_pool_lock);
        pthread_cond_broadcast(&og_pool_wake);
        pthread_mutex_unlock(&og_pool_lock);
    }
    og_run_shares(job);
    for (long spins = 0; atomic_load_explicit(&og_done, memory_order_acquire) < nt; spins++) {
        if (spins > OG_SPINS)
            sched_yield();
        else
            og_relax();
    }
    atomic_store_explicit(&og_busy, 0, memory_order_release);
}

#endif

/* ------------------------------------------------------------------------------------------ */
/* The model                                                                                  */
/* ------------------------------------------------------------------------------------------ */

static size_t og_bank_bytes(void) {
    size_t total = 0;
    for (int k = 0; k < OG_NARRAYS; k++) total += og_round((size_t)og_arrays[k].count * sizeof(float));
    return total;
}

static void og_reset_state(opgrad_model *m) {
    for (int k = OG_NPARAMS; k < OG_NARRAYS; k++) {
        float *p = (float *)m->train_bufs[og_arrays[k].train_param];
        for (int64_t i = 0; i < og_arrays[k].count; i++) p[i] = (float)og_arrays[k].init;
    }
}

opgrad_model *opgrad_model_create(void) {
    opgrad_model *m = (opgrad_model *)calloc(1, sizeof *m);
    if (!m) return NULL;
    int nthreads = og_pool_acquire();
    size_t bank = og_bank_bytes();
    m->train_arena = (unsigned char *)og_alloc(OG_TRAIN_ARENA);
    m->eval_arena = (unsigned char *)og_alloc(OG_EVAL_ARENA);
    m->ws = (unsigned char *)og_alloc((size_t)OG_WS_PER_THREAD * (size_t)nthreads);
    m->banks[0] = (unsigned char *)og_alloc(bank);
    m->banks[1] = (unsigned char *)og_alloc(bank);
    if (!m->train_arena || !m->eval_arena || !m->ws || !m->banks[0] || !m->banks[1]) {
        opgrad_model_free(m);
        return NULL;
    }
    for (int s = 0; s < OG_TRAIN_SLOTS; s++)
        if (og_train_offsets[s] >= 0) m->train_bufs[s] = m->train_arena + og_train_offsets[s];
    for (int s = 0; s < OG_EVAL_SLOTS; s++)
        if (og_eval_offsets[s] >= 0) m->eval_bufs[s] = m->eval_arena + og_eval_offsets[s];
    for (int c = 0; c < OG_TRAIN_NCONSTS; c++) m->train_bufs[og_train_consts[c].slot] = (void *)og_train_consts[c].data;
    for (int c = 0; c < OG_EVAL_NCONSTS; c++) m->eval_bufs[og_eval_consts[c].slot] = (void *)og_eval_consts[c].data;
    size_t off = 0;
    for (int k = 0; k < OG_NARRAYS; k++) {
        m->train_bufs[og_arrays[k].train_param] = m->banks[0] + off;
        m->train_bufs[og_arrays[k].train_result] = m->banks[1] + off;
        off += og_round((size_t)og_arrays[k].count * sizeof(float));
    }
    og_reset_state(m);
    return m;
}

void opgrad_model_free(opgrad_model *m) {
    if (!m) return;
    free(m->train_arena);
    free(m->eval_arena);
    free(m->ws);
    free(m->banks[0]);
    free(m->banks[1]);
    free(m);
    og_pool_release();
}

const char *opgrad_last_error(const opgrad_model *m) {
    if (!m) return "opgrad_last_error: model is NULL (opgrad_model_create returns NULL when memory runs out)";
    return m->error;
}

int64_t opgrad_model_step(const opgrad_model *m) { return m ? m->step : -1; }

int64_t opgrad_model_epoch(const opgrad_model *m) { return m ? m->epoch : -1; }

int opgrad_model_set_epoch(opgrad_model *m, int64_t epoch) {
    if (!m) return OPGRAD_ERR_NULL;
    if (epoch < 0) return og_fail(m, OPGRAD_ERR_ARGUMENT, "opgrad_model_set_epoch: epoch must be >= 0, got %lld", (long long)epoch);
    m->epoch = epoch;
    m->error[0] = '\0';
    return OPGRAD_OK;
}

float *opgrad_model_array(opgrad_model *m, const char *name, int64_t *count) {
    if (!m) return NULL;
    if (!name) {
        og_fail(m, OPGRAD_ERR_NULL, "opgrad_model_array: name is NULL");
        return NULL;
    }
    for (int k = 0; k < OG_NARRAYS; k++)
        if (strcmp(og_arrays[k].name, name) == 0) {
            if (count) *count = og_arrays[k].count;
            m->error[0] = '\0';
            return (float *)m->train_bufs[og_arrays[k].train_param];
        }
    og_fail(m, OPGRAD_ERR_ARGUMENT, "opgrad_model_array: no parameter or state array named '%s'", name);
    return NULL;
}

static int og_misaligned(const void *p, size_t align) { return ((uintptr_t)p % align) != 0; }

/* Run `steps` training steps through the compiled loop; streams[i] is the batch-major array of
 * stream i (images, labels, masks..., learning rates). */
static int og_train_run(opgrad_model *m, const char *who, int64_t steps, const void *const *streams,
                        float *losses, int flags) {
    if (!m) return OPGRAD_ERR_NULL;
    if (steps < 0) return og_fail(m, OPGRAD_ERR_ARGUMENT, "%s: steps must be >= 0, got %lld", who, (long long)steps);
    for (int i = 0; i < OG_NSTREAMS; i++) {
        if (!streams[i]) return og_fail(m, OPGRAD_ERR_NULL, "%s: %s is NULL", who, og_streams[i].name);
        if (og_misaligned(streams[i], og_streams[i].align))
            return og_fail(m, OPGRAD_ERR_ARGUMENT, "%s: %s is not aligned to %d bytes (its element size)", who,
                           og_streams[i].name, og_streams[i].align);
    }
    if (!losses) return og_fail(m, OPGRAD_ERR_NULL, "%s: losses is NULL", who);
    if (og_misaligned(losses, sizeof(float)))
        return og_fail(m, OPGRAD_ERR_ARGUMENT, "%s: losses is not aligned to 4 bytes", who);
    if (flags & ~OPGRAD_STOP_ON_NAN) return og_fail(m, OPGRAD_ERR_ARGUMENT, "%s: unknown flags 0x%x", who, flags);
    for (int i = 0; i < OG_NSTREAMS; i++) m->train_bufs[og_streams[i].slot] = (void *)streams[i];
    m->train_bufs[OG_LOSS_SLOT] = losses;
    int64_t status[OG_STATUS_WORDS] = {0};
    int32_t rc = OG_TRAIN_LOOP(m->train_bufs, m->ws, steps, flags, status);
    m->step += status[0];
    if (rc == 1) {
        const og_check *c = &og_checks[status[4]];
        return og_fail(m, OPGRAD_ERR_LABEL,
                       "%s: %s[%lld] = %lld (step %lld, row %lld of its batch) is out of range [%lld, %lld) for "
                       "input '%s' of %s; steps %lld.. did not run (%lld done)",
                       who, c->argument, (long long)(status[1] * c->per_step + status[2]), (long long)status[3],
                       (long long)status[1], (long long)status[2], (long long)c->low, (long long)c->high, c->input,
                       c->op, (long long)status[1], (long long)status[0]);
    }
    if (rc == 2 && status[1] == 0)
        return og_fail(m, OPGRAD_ERR_NAN,
                       "%s: the loss is NaN or infinite at step 0; stopped there (OPGRAD_STOP_ON_NAN): the parameters "
                       "are unchanged by this call",
                       who);
    if (rc == 2)
        return og_fail(m, OPGRAD_ERR_NAN,
                       "%s: the loss is NaN or infinite at step %lld; stopped there (OPGRAD_STOP_ON_NAN): the "
                       "parameters are those after step %lld of this call",
                       who, (long long)status[1], (long long)status[1] - 1);
    if (rc != 0) return og_fail(m, OPGRAD_ERR_ARGUMENT, "%s: the compiled loop returned %d", who, (int)rc);
    m->error[0] = '\0';
    return OPGRAD_OK;
}

int opgrad_eval(opgrad_model *m, const float *images, float *logits) {
    if (!m) return OPGRAD_ERR_NULL;
    if (!images) return og_fail(m, OPGRAD_ERR_NULL, "opgrad_eval: images is NULL");
    if (!logits) return og_fail(m, OPGRAD_ERR_NULL, "opgrad_eval: logits is NULL");
    if (og_misaligned(images, sizeof(float)) || og_misaligned(logits, sizeof(float)))
        return og_fail(m, OPGRAD_ERR_ARGUMENT, "opgrad_eval: images and logits must be aligned to 4 bytes");
    for (int k = 0; k < OG_NPARAMS; k++) m->eval_bufs[og_arrays[k].eval_param] = m->train_bufs[og_arrays[k].train_param];
    m->eval_bufs[OG_EVAL_IMAGES_SLOT] = (void *)images;
    m->eval_bufs[OG_EVAL_LOGITS_SLOT] = logits;
    OG_EVAL_ENTRY(m->eval_bufs, m->ws);
    m->error[0] = '\0';
    return OPGRAD_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Checksums: CRC-32 (zip entries) and SHA-256 (the checkpoint's own digest)                  */
/* ------------------------------------------------------------------------------------------ */

static uint32_t og_crc32(uint32_t crc, const unsigned char *p, size_t n) {
    static uint32_t table[256];
    static int ready; /* benign: every thread computes the same table */
    if (!ready) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            table[i] = c;
        }
        ready = 1;
    }
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    unsigned char buf[64];
    size_t used;
} og_sha256;

static const uint32_t og_sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define OG_ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void og_sha_block(og_sha256 *s, const unsigned char *p) {
    uint32_t w[64], a, b, c, d, e, f, g, h;
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = OG_ROR(w[i - 15], 7) ^ OG_ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = OG_ROR(w[i - 2], 17) ^ OG_ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (OG_ROR(e, 6) ^ OG_ROR(e, 11) ^ OG_ROR(e, 25)) + ((e & f) ^ (~e & g)) + og_sha_k[i] + w[i];
        uint32_t t2 = (OG_ROR(a, 2) ^ OG_ROR(a, 13) ^ OG_ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    s->h[0] += a, s->h[1] += b, s->h[2] += c, s->h[3] += d, s->h[4] += e, s->h[5] += f, s->h[6] += g, s->h[7] += h;
}

static void og_sha_init(og_sha256 *s) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof h0);
    s->bytes = 0;
    s->used = 0;
}

static void og_sha_update(og_sha256 *s, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    s->bytes += n;
    while (n) {
        if (s->used == 0 && n >= 64) {
            og_sha_block(s, p);
            p += 64, n -= 64;
            continue;
        }
        size_t take = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->buf + s->used, p, take);
        s->used += take, p += take, n -= take;
        if (s->used == 64) {
            og_sha_block(s, s->buf);
            s->used = 0;
        }
    }
}

static void og_sha_hex(og_sha256 *s, char out[65]) {
    uint64_t bits = s->bytes * 8;
    unsigned char pad = 0x80, zero = 0, len[8];
    og_sha_update(s, &pad, 1);
    while (s->used != 56) og_sha_update(s, &zero, 1);
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)(bits >> (56 - 8 * i));
    og_sha_update(s, len, 8);
    for (int i = 0; i < 8; i++) snprintf(out + 8 * i, 9, "%08x", s->h[i]);
}

/* ------------------------------------------------------------------------------------------ */
/* Checkpoints: the .npz that opgrad.checkpoint writes (a zip of stored, uncompressed .npy     */
/* entries plus __opgrad_format__, __meta__ (JSON) and __sha256__ over every array)            */
/* ------------------------------------------------------------------------------------------ */

#define OG_MAX_ENTRIES 4096
#define OG_MAX_DIMS 8

typedef struct {
    char name[256];                /* without ".npy" */
    char descr[16];                /* e.g. "<f4" */
    int ndim;
    int64_t shape[OG_MAX_DIMS];
    const unsigned char *data;     /* points into the file's bytes */
    uint64_t nbytes;
} og_entry;

static uint16_t og_u16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t og_u32(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t og_u64(const unsigned char *p) { return (uint64_t)og_u32(p) | (uint64_t)og_u32(p + 4) << 32; }
/* Whether len bytes from offset off lie inside size: without the wrap-around of off + len that a
   crafted 64-bit zip64 size or offset would cause. */
static int og_fits(uint64_t off, uint64_t len, uint64_t size) { return off <= size && len <= size - off; }

/* The shape as Python prints a tuple: "()", "(10,)", "(32, 1, 3, 3)"; the digest hashes it. */
static void og_shape_text(const int64_t *shape, int ndim, char *out, size_t cap) {
    size_t n = (size_t)snprintf(out, cap, "(");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(out + n, cap - n, d + 1 < ndim ? "%lld, " : (ndim == 1 ? "%lld," : "%lld"),
                              (long long)shape[d]);
    if (n < cap) snprintf(out + n, cap - n, ")");
}

/* Parse a .npy member: magic, version, then the header dict {'descr', 'fortran_order', 'shape'}. */
static int og_parse_npy(opgrad_model *m, const char *path, og_entry *e, const unsigned char *p, uint64_t n) {
    if (n < 10 || memcmp(p, "\x93NUMPY", 6) != 0)
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' is not a .npy array", path, e->name);
    uint64_t hlen, start;
    if (p[6] == 1) {
        hlen = og_u16(p + 8), start = 10;
    } else if (p[6] == 2 || p[6] == 3) {
        if (n < 12) return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' is truncated", path, e->name);
        hlen = og_u32(p + 8), start = 12;
    } else {
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' has .npy version %d, expected 1, 2 or 3", path,
                       e->name, p[6]);
    }
    if (start + hlen > n || hlen > 4096)
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' has a truncated .npy header", path, e->name);
    char h[4097];
    memcpy(h, p + start, hlen);
    h[hlen] = '\0';
    const char *d = strstr(h, "'descr':");
    const char *f = strstr(h, "'fortran_order':");
    const char *s = strstr(h, "'shape':");
    if (!d || !f || !s) return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' has a malformed .npy header", path, e->name);
    d = strchr(d + 8, '\'');
    const char *d_end = d ? strchr(d + 1, '\'') : NULL;
    if (!d || !d_end || (size_t)(d_end - d - 1) >= sizeof e->descr)
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' has a malformed dtype", path, e->name);
    memcpy(e->descr, d + 1, (size_t)(d_end - d - 1));
    e->descr[d_end - d - 1] = '\0';
    f += 16;
    while (*f == ' ') f++;
    s = strchr(s + 8, '(');
    if (!s) return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' has a malformed shape", path, e->name);
    e->ndim = 0;
    for (s++; *s && *s != ')';) {
        while (*s == ' ' || *s == ',') s++;
        if (*s == ')') break;
        char *end = NULL;
        long long v = strtoll(s, &end, 10);
        if (end == s || v < 0 || e->ndim == OG_MAX_DIMS)
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' has a malformed shape", path, e->name);
        e->shape[e->ndim++] = v;
        s = end;
    }
    uint64_t count = 1;
    for (int k = 0; k < e->ndim; k++) count *= (uint64_t)e->shape[k];
    if (strncmp(f, "True", 4) == 0 && e->ndim > 1)
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' is stored in Fortran order; save C-ordered arrays",
                       path, e->name);
    e->data = p + start + hlen;
    e->nbytes = n - start - hlen;
    int isize = atoi(e->descr + 2);
    if (e->descr[1] == 'U') isize *= 4; /* numpy's unicode: UTF-32 code units */
    if (isize <= 0 || count * (uint64_t)isize != e->nbytes)
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' holds %llu bytes, its header says %llu x %s", path,
                       e->name, (unsigned long long)e->nbytes, (unsigned long long)count, e->descr);
    return OPGRAD_OK;
}

/* Index a zip archive of stored entries (central directory, zip64 where sizes need it). */
static int og_read_zip(opgrad_model *m, const char *path, const unsigned char *buf, uint64_t size, og_entry *entries,
                       int *count) {
    if (size < 22 || memcmp(buf, "PK\x03\x04", 4) != 0)
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: not an .npz checkpoint (the file does not start with a zip header)", path);
    int64_t eocd = -1;
    for (int64_t i = (int64_t)size - 22; i >= 0 && i >= (int64_t)size - 22 - 65535; i--)
        if (og_u32(buf + i) == 0x06054b50u) {
            eocd = i;
            break;
        }
    if (eocd < 0)
        return og_fail(m, OPGRAD_ERR_FORMAT, "%s: corrupt or truncated checkpoint (no zip end record; %llu bytes)",
                       path, (unsigned long long)size);
    uint64_t n = og_u16(buf + eocd + 10), cd = og_u32(buf + eocd + 16);
    if ((n == 0xffff || cd == 0xffffffffu) && eocd >= 20 && og_u32(buf + eocd - 20) == 0x07064b50u) {
        uint64_t z = og_u64(buf + eocd - 20 + 8);
        if (!og_fits(z, 56, size) || og_u32(buf + z) != 0x06064b50u)
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: corrupt zip64 end record", path);
        n = og_u64(buf + z + 32), cd = og_u64(buf + z + 48);
    }
    if (n > OG_MAX_ENTRIES) return og_fail(m, OPGRAD_ERR_FORMAT, "%s: %llu entries, more than %d", path, (unsigned long long)n, OG_MAX_ENTRIES);
    uint64_t at = cd;
    for (uint64_t i = 0; i < n; i++) {
        if (!og_fits(at, 46, size) || og_u32(buf + at) != 0x02014b50u)
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: corrupt zip central directory (entry %llu)", path, (unsigned long long)i);
        const unsigned char *c = buf + at;
        uint16_t flags = og_u16(c + 8), method = og_u16(c + 10), nlen = og_u16(c + 28), xlen = og_u16(c + 30),
                 clen = og_u16(c + 32);
        uint32_t crc = og_u32(c + 16);
        uint64_t csize = og_u32(c + 20), usize = og_u32(c + 24), local = og_u32(c + 42);
        if (!og_fits(at, 46u + nlen + xlen, size))
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: corrupt zip central directory", path);
        const unsigned char *extra_end = c + 46 + nlen + xlen;
        for (const unsigned char *x = c + 46 + nlen; x + 4 <= extra_end;) { /* zip64 sizes/offset */
            uint16_t id = og_u16(x), len = og_u16(x + 2);
            const unsigned char *v = x + 4, *field_end = v + len;
            if (field_end > extra_end)
                return og_fail(m, OPGRAD_ERR_FORMAT, "%s: corrupt zip extra field (entry %llu)", path, (unsigned long long)i);
            if (id == 1) {
                if (usize == 0xffffffffu && v + 8 <= field_end) usize = og_u64(v), v += 8;
                if (csize == 0xffffffffu && v + 8 <= field_end) csize = og_u64(v), v += 8;
                if (local == 0xffffffffu && v + 8 <= field_end) local = og_u64(v);
            }
            x = field_end;
        }
        og_entry *e = &entries[i];
        if (nlen < 5 || nlen - 4 >= (int)sizeof e->name || memcmp(c + 46 + nlen - 4, ".npy", 4) != 0)
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry %llu is not a .npy file", path, (unsigned long long)i);
        memcpy(e->name, c + 46, nlen - 4u);
        e->name[nlen - 4] = '\0';
        if (flags & 1) return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' is encrypted", path, e->name);
        if (method != 0)
            return og_fail(m, OPGRAD_ERR_FORMAT,
                           "%s: entry '%s' is compressed (zip method %u); opgrad checkpoints store entries "
                           "uncompressed: re-save it with opgrad.checkpoint.save_checkpoint", path, e->name, method);
        if (csize != usize || !og_fits(local, 30, size) || og_u32(buf + local) != 0x04034b50u)
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' has a corrupt local header", path, e->name);
        uint64_t data = local + 30 + og_u16(buf + local + 26) + og_u16(buf + local + 28);
        if (!og_fits(data, usize, size))
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: corrupt or truncated checkpoint (entry '%s' runs past the end)",
                           path, e->name);
        if (og_crc32(0, buf + data, usize) != crc)
            return og_fail(m, OPGRAD_ERR_FORMAT, "%s: entry '%s' fails its CRC-32 check (corrupt file)", path, e->name);
        int rc = og_parse_npy(m, path, e, buf + data, usize);
        if (rc) return rc;
        at += 46 + nlen + xlen + clen;
    }
    *count = (int)n;
    return OPGRAD_OK;
}

static int og_by_name(const void *a, const void *b) {
    return strcmp((*(const og_entry *const *)a)->name, (*(const og_entry *const *)b)->name);
}

/* Append the UTF-8 encoding of a numpy unicode (UTF-32LE) array to out; trailing NULs dropped. */
static size_t og_utf8(const og_entry *e, char *out, size_t cap) {
    size_t units = (size_t)(e->nbytes / 4), n = 0;
    while (units && og_u32(e->data + 4 * (units - 1)) == 0) units--;
    for (size_t i = 0; i < units; i++) {
        uint32_t c = og_u32(e->data + 4 * i);
        unsigned char b[4];
        size_t k;
        if (c < 0x80) b[0] = (unsigned char)c, k = 1;
        else if (c < 0x800) b[0] = (unsigned char)(0xc0 | c >> 6), b[1] = (unsigned char)(0x80 | (c & 0x3f)), k = 2;
        else if (c < 0x10000)
            b[0] = (unsigned char)(0xe0 | c >> 12), b[1] = (unsigned char)(0x80 | (c >> 6 & 0x3f)),
            b[2] = (unsigned char)(0x80 | (c & 0x3f)), k = 3;
        else
            b[0] = (unsigned char)(0xf0 | c >> 18), b[1] = (unsigned char)(0x80 | (c >> 12 & 0x3f)),
            b[2] = (unsigned char)(0x80 | (c >> 6 & 0x3f)), b[3] = (unsigned char)(0x80 | (c & 0x3f)), k = 4;
        if (n + k >= cap) return (size_t)-1;
        memcpy(out + n, b, k);
        n += k;
    }
    out[n] = '\0';
    return n;
}

/* The raw text of top-level key `key` of a JSON object (a number, or a string without quotes). */
static int og_json_get(const char *json, const char *key, char *out, size_t cap) {
    int depth = 0;
    size_t klen = strlen(key);
    for (const char *p = json; *p; p++) {
        if (*p == '"') {
            const char *s = ++p;
            while (*p && *p != '"') p += (*p == '\\' && p[1]) ? 2 : 1;
            if (!*p) return 0;
            const char *q = p + 1;
            while (*q == ' ') q++;
            if (depth == 1 && *q == ':' && (size_t)(p - s) == klen && strncmp(s, key, klen) == 0) {
                q++;
                while (*q == ' ') q++;
                size_t n = 0;
                if (*q == '"') {
                    for (q++; *q && *q != '"' && n + 1 < cap; q++) {
                        if (*q == '\\' && q[1]) q++;
                        out[n++] = *q;
                    }
                } else {
                    while (*q && *q != ',' && *q != '}' && n + 1 < cap) out[n++] = *q++;
                }
                out[n] = '\0';
                return 1;
            }
        } else if (*p == '{' || *p == '[') {
            depth++;
        } else if (*p == '}' || *p == ']') {
            depth--;
        }
    }
    return 0;
}

int opgrad_model_load(opgrad_model *m, const char *path) {
    if (!m) return OPGRAD_ERR_NULL;
    if (!path) return og_fail(m, OPGRAD_ERR_NULL, "opgrad_model_load: path is NULL");
    FILE *fp = fopen(path, "rb");
    if (!fp) return og_fail(m, OPGRAD_ERR_IO, "%s: cannot open checkpoint: %s", path, strerror(errno));
    struct stat info;
    if (fstat(fileno(fp), &info) != 0 || !S_ISREG(info.st_mode)) { /* a directory opens, then sizes as LONG_MAX */
        fclose(fp);
        return og_fail(m, OPGRAD_ERR_IO, "%s: cannot read checkpoint: not a regular file", path);
    }
    unsigned char *buf = NULL;
    og_entry *entries = NULL;
    og_entry **sorted = NULL;
    char *meta_json = NULL;
    int rc = OPGRAD_OK, count = 0;
    long size = -1;
    if (fseek(fp, 0, SEEK_END) == 0) size = ftell(fp);
    if (size < 0 || fseek(fp, 0, SEEK_SET) != 0) {
        rc = og_fail(m, OPGRAD_ERR_IO, "%s: cannot read checkpoint: %s", path, strerror(errno));
        goto done;
    }
    if (size == 0) {
        rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: empty file (0 bytes): the save that wrote it never finished", path);
        goto done;
    }
    buf = (unsigned char *)malloc((size_t)size);
    entries = (og_entry *)calloc(OG_MAX_ENTRIES, sizeof *entries);
    sorted = (og_entry **)calloc(OG_MAX_ENTRIES, sizeof *sorted);
    if (!buf || !entries || !sorted) {
        rc = og_fail(m, OPGRAD_ERR_NOMEM, "%s: out of memory reading %ld bytes", path, size);
        goto done;
    }
    if (fread(buf, 1, (size_t)size, fp) != (size_t)size) {
        rc = og_fail(m, OPGRAD_ERR_IO, "%s: cannot read checkpoint: %s", path, ferror(fp) ? strerror(errno) : "short read");
        goto done;
    }
    rc = og_read_zip(m, path, buf, (uint64_t)size, entries, &count);
    if (rc) goto done;

    const og_entry *format = NULL, *meta = NULL, *hash = NULL;
    int narrays = 0;
    for (int i = 0; i < count; i++) {
        if (strcmp(entries[i].name, "__opgrad_format__") == 0) format = &entries[i];
        else if (strcmp(entries[i].name, "__meta__") == 0) meta = &entries[i];
        else if (strcmp(entries[i].name, "__sha256__") == 0) hash = &entries[i];
        else sorted[narrays++] = &entries[i];
    }
    if (!format || !meta || !hash) {
        rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: not an opgrad checkpoint (no %s entry)", path,
                     !format ? "__opgrad_format__" : !meta ? "__meta__" : "__sha256__");
        goto done;
    }
    if (strcmp(format->descr, "<i8") != 0 || format->ndim != 0 || og_u64(format->data) != 1) {
        rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: checkpoint format version %lld, this runtime reads version 1", path,
                     (long long)og_u64(format->data));
        goto done;
    }
    meta_json = (char *)malloc((size_t)meta->nbytes + 1); /* UTF-8 needs at most 4 bytes a code point */
    if (!meta_json) {
        rc = og_fail(m, OPGRAD_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    char stored[72];
    if (meta->descr[1] != 'U' || og_utf8(meta, meta_json, (size_t)meta->nbytes + 1) == (size_t)-1 || hash->descr[1] != 'U' ||
        og_utf8(hash, stored, sizeof stored) != 64) {
        rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: malformed checkpoint header entries", path);
        goto done;
    }
    /* The digest of opgrad.checkpoint: version, metadata, then every array by name in sorted order. */
    qsort(sorted, (size_t)narrays, sizeof *sorted, og_by_name);
    og_sha256 sha;
    og_sha_init(&sha);
    og_sha_update(&sha, "opgrad-checkpoint-v1", 21);
    og_sha_update(&sha, meta_json, strlen(meta_json) + 1);
    for (int i = 0; i < narrays; i++) {
        char shape[256];
        og_shape_text(sorted[i]->shape, sorted[i]->ndim, shape, sizeof shape);
        og_sha_update(&sha, sorted[i]->name, strlen(sorted[i]->name) + 1);
        og_sha_update(&sha, sorted[i]->descr, strlen(sorted[i]->descr) + 1);
        og_sha_update(&sha, shape, strlen(shape) + 1);
        og_sha_update(&sha, sorted[i]->data, (size_t)sorted[i]->nbytes);
    }
    char actual[65];
    og_sha_hex(&sha, actual);
    if (strcmp(actual, stored) != 0) {
        rc = og_fail(m, OPGRAD_ERR_FORMAT,
                     "%s: checksum mismatch: contents were modified or corrupted after saving (stored sha256 %.12s..., "
                     "actual %.12s...)", path, stored, actual);
        goto done;
    }
    char value[256];
    if (og_json_get(meta_json, "model", value, sizeof value) && strcmp(value, OG_META_MODEL) != 0) {
        rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: checkpoint is of model '%s', this library trains '%s'", path, value,
                     OG_META_MODEL);
        goto done;
    }
    /* Exactly the parameters, plus either all of the optimizer state or none of it (then reset). */
    const og_entry *found[OG_NARRAYS];
    int nstate = 0;
    for (int k = 0; k < OG_NARRAYS; k++) {
        found[k] = NULL;
        for (int i = 0; i < narrays; i++)
            if (strcmp(sorted[i]->name, og_arrays[k].name) == 0) found[k] = sorted[i];
        if (k >= OG_NPARAMS && found[k]) nstate++;
    }
    for (int i = 0; i < narrays; i++) {
        int known = 0;
        for (int k = 0; k < OG_NARRAYS; k++) known |= strcmp(sorted[i]->name, og_arrays[k].name) == 0;
        if (!known) {
            /* Another optimizer's state is the likely cause: say so rather than only name the array. */
            char trained[256];
            if (og_json_get(meta_json, "optimizer", trained, sizeof trained) && strcmp(trained, OG_META_OPTIMIZER) != 0)
                rc = og_fail(m, OPGRAD_ERR_FORMAT,
                             "%s: checkpoint was trained with '%s'; this library uses '%s' (its state has no "
                             "array %s); export it with that optimizer (opgrad export --optimizer)", path, trained,
                             OG_META_OPTIMIZER, sorted[i]->name);
            else
                rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: unexpected array the model does not have: %s", path,
                             sorted[i]->name);
            goto done;
        }
    }
    for (int k = 0; k < OG_NARRAYS; k++) {
        if (!found[k] && (k < OG_NPARAMS || nstate > 0)) {
            rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: missing array the model needs: %s", path, og_arrays[k].name);
            goto done;
        }
        if (!found[k]) continue;
        char want[256], got[256];
        og_shape_text(og_arrays[k].shape, og_arrays[k].ndim, want, sizeof want);
        og_shape_text(found[k]->shape, found[k]->ndim, got, sizeof got);
        if (strcmp(want, got) != 0) {
            rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: %s: checkpoint has shape %s, model expects %s", path,
                         og_arrays[k].name, got, want);
            goto done;
        }
        if (strcmp(found[k]->descr, "<f4") != 0) {
            rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: %s: checkpoint has dtype %s, model expects <f4 (float32)", path,
                         og_arrays[k].name, found[k]->descr);
            goto done;
        }
    }
    if (nstate > 0 && og_json_get(meta_json, "optimizer", value, sizeof value) && strcmp(value, OG_META_OPTIMIZER) != 0) {
        rc = og_fail(m, OPGRAD_ERR_FORMAT, "%s: checkpoint was trained with '%s'; this library uses '%s'", path, value,
                     OG_META_OPTIMIZER);
        goto done;
    }
    /* Everything checked: copy into the spare bank and make it current, so a failed load above
     * left the model as it was. */
    for (int k = 0; k < OG_NARRAYS; k++) {
        void *spare = m->train_bufs[og_arrays[k].train_result];
        if (found[k]) memcpy(spare, found[k]->data, (size_t)found[k]->nbytes);
        else memcpy(spare, m->train_bufs[og_arrays[k].train_param], (size_t)og_arrays[k].count * sizeof(float));
        m->train_bufs[og_arrays[k].train_result] = m->train_bufs[og_arrays[k].train_param];
        m->train_bufs[og_arrays[k].train_param] = spare;
    }
    if (nstate == 0) og_reset_state(m);
    m->step = og_json_get(meta_json, "step", value, sizeof value) ? strtoll(value, NULL, 10) : 0;
    m->epoch = og_json_get(meta_json, "epoch", value, sizeof value) ? strtoll(value, NULL, 10) : 0;
    m->error[0] = '\0';
done:
    free(meta_json);
    free(sorted);
    free(entries);
    free(buf);
    fclose(fp);
    return rc;
}

/* ----- writing ----- */

typedef struct {
    FILE *fp;
    uint64_t offset;
    int failed;
    unsigned char *central;
    size_t central_len, central_cap;
    int count;
} og_zip;

static void og_put(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static void og_write(og_zip *z, const void *p, size_t n) {
    if (!z->failed && fwrite(p, 1, n, z->fp) != n) z->failed = 1;
    z->offset += n;
}

/* One stored zip member `name.npy`: a .npy v1.0 header padded to 64 bytes, then `data`. */
static void og_zip_array(og_zip *z, const char *name, const char *descr, const int64_t *shape, int ndim,
                         const void *data, size_t nbytes) {
    char header[512], shape_text[256];
    og_shape_text(shape, ndim, shape_text, sizeof shape_text);
    int hl = snprintf(header + 10, sizeof header - 10, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                      descr, shape_text);
    int total = (10 + hl + 1 + 63) / 64 * 64;
    memset(header + 10 + hl, ' ', (size_t)(total - 10 - hl - 1));
    header[total - 1] = '\n';
    memcpy(header, "\x93NUMPY\x01\x00", 8);
    og_put((unsigned char *)header + 8, (uint64_t)(total - 10), 2);
    uint32_t crc = og_crc32(og_crc32(0, (const unsigned char *)header, (size_t)total), (const unsigned char *)data, nbytes);
    uint64_t size = (uint64_t)total + nbytes, local = z->offset;
    size_t nlen = strlen(name) + 4;
    if (size >= 0xffffffffu || local >= 0xffffffffu) z->failed = 2; /* zip64 is not written: 4 GiB limit */
    unsigned char lh[30] = {0}; /* dated 1980-01-01 00:00, the zip epoch, so equal models give equal files */
    og_put(lh, 0x04034b50u, 4), og_put(lh + 4, 20, 2), og_put(lh + 12, 0x21, 2), og_put(lh + 14, crc, 4);
    og_put(lh + 18, size, 4), og_put(lh + 22, size, 4), og_put(lh + 26, nlen, 2);
    og_write(z, lh, 30);
    og_write(z, name, nlen - 4);
    og_write(z, ".npy", 4);
    og_write(z, header, (size_t)total);
    og_write(z, data, nbytes);
    if (z->central_len + 46 + nlen > z->central_cap) {
        size_t cap = (z->central_cap + 46 + nlen) * 2;
        unsigned char *grown = (unsigned char *)realloc(z->central, cap);
        if (!grown) {
            z->failed = 3;
            return;
        }
        z->central = grown, z->central_cap = cap;
    }
    unsigned char *c = z->central + z->central_len;
    memset(c, 0, 46);
    og_put(c, 0x02014b50u, 4), og_put(c + 4, 3 << 8 | 20, 2), og_put(c + 6, 20, 2), og_put(c + 14, 0x21, 2);
    og_put(c + 16, crc, 4), og_put(c + 20, size, 4), og_put(c + 24, size, 4), og_put(c + 28, nlen, 2);
    og_put(c + 38, 0100644u << 16, 4), og_put(c + 42, local, 4); /* a regular file, rw-r--r-- */
    memcpy(c + 46, name, nlen - 4);
    memcpy(c + 46 + nlen - 4, ".npy", 4);
    z->central_len += 46 + nlen;
    z->count++;
}

static void og_zip_text(og_zip *z, const char *name, const char *text) {
    size_t n = strlen(text);
    unsigned char *units = (unsigned char *)malloc(4 * (n ? n : 1));
    if (!units) {
        z->failed = 3;
        return;
    }
    for (size_t i = 0; i < n; i++) og_put(units + 4 * i, (unsigned char)text[i], 4); /* ASCII -> UTF-32LE */
    char descr[32];
    snprintf(descr, sizeof descr, "<U%zu", n ? n : 1);
    og_zip_array(z, name, descr, NULL, 0, units, 4 * (n ? n : 1));
    free(units);
}

static int og_by_array_name(const void *a, const void *b) {
    return strcmp(og_arrays[*(const int *)a].name, og_arrays[*(const int *)b].name);
}

int opgrad_model_save(opgrad_model *m, const char *path) {
    if (!m) return OPGRAD_ERR_NULL;
    if (!path) return og_fail(m, OPGRAD_ERR_NULL, "opgrad_model_save: path is NULL");
    /* The counters, then the generated fields (og_saved_meta past its opening brace). The architecture
     * makes the metadata as long as the model is deep, so it is sized from the table, not fixed. */
    size_t meta_cap = sizeof og_saved_meta + 64;
    char *meta = (char *)malloc(meta_cap);
    if (!meta) return og_fail(m, OPGRAD_ERR_NOMEM, "%s: out of memory", path);
    snprintf(meta, meta_cap, "{\"epoch\": %lld, \"step\": %lld, %s", (long long)m->epoch, (long long)m->step,
             og_saved_meta + 1);
    int order[OG_NARRAYS];
    for (int k = 0; k < OG_NARRAYS; k++) order[k] = k;
    qsort(order, OG_NARRAYS, sizeof order[0], og_by_array_name);
    og_sha256 sha;
    og_sha_init(&sha);
    og_sha_update(&sha, "opgrad-checkpoint-v1", 21);
    og_sha_update(&sha, meta, strlen(meta) + 1);
    for (int i = 0; i < OG_NARRAYS; i++) {
        const og_array *a = &og_arrays[order[i]];
        char shape[256];
        og_shape_text(a->shape, a->ndim, shape, sizeof shape);
        og_sha_update(&sha, a->name, strlen(a->name) + 1);
        og_sha_update(&sha, "<f4", 4);
        og_sha_update(&sha, shape, strlen(shape) + 1);
        og_sha_update(&sha, m->train_bufs[a->train_param], (size_t)a->count * sizeof(float));
    }
    char digest[65];
    og_sha_hex(&sha, digest);

    /* Write next to the target, then rename over it: a reader sees the old file or the new one. */
    size_t plen = strlen(path);
    char *tmp = (char *)malloc(plen + 48);
    if (!tmp) {
        free(meta);
        return og_fail(m, OPGRAD_ERR_NOMEM, "%s: out of memory", path);
    }
    /* Named by process and model: two models saving to one path from two threads write apart. */
    snprintf(tmp, plen + 48, "%s.%ld.%p.tmp", path, (long)getpid(), (void *)m);
    og_zip z = {0};
    z.fp = fopen(tmp, "wb");
    if (!z.fp) {
        int rc = og_fail(m, OPGRAD_ERR_IO, "%s: cannot write checkpoint: %s", path, strerror(errno));
        free(tmp);
        free(meta);
        return rc;
    }
    for (int k = 0; k < OG_NARRAYS; k++)
        og_zip_array(&z, og_arrays[k].name, "<f4", og_arrays[k].shape, og_arrays[k].ndim,
                     m->train_bufs[og_arrays[k].train_param], (size_t)og_arrays[k].count * sizeof(float));
    int64_t version = 1;
    og_zip_array(&z, "__opgrad_format__", "<i8", NULL, 0, &version, 8);
    og_zip_text(&z, "__meta__", meta);
    og_zip_text(&z, "__sha256__", digest);
    unsigned char end[22] = {0};
    uint64_t cd = z.offset;
    og_write(&z, z.central, z.central_len);
    og_put(end, 0x06054b50u, 4), og_put(end + 8, (uint64_t)z.count, 2), og_put(end + 10, (uint64_t)z.count, 2);
    og_put(end + 12, z.central_len, 4), og_put(end + 16, cd, 4);
    og_write(&z, end, 22);
    free(z.central);
    free(meta);
    int failed = z.failed || fflush(z.fp) != 0 || fsync(fileno(z.fp)) != 0;
    int saved_errno = errno;
    failed |= fclose(z.fp) != 0;
    if (failed || rename(tmp, path) != 0) {
        if (!failed) saved_errno = errno;
        remove(tmp);
        free(tmp);
        if (z.failed == 2) return og_fail(m, OPGRAD_ERR_IO, "%s: checkpoint larger than 4 GiB", path);
        return og_fail(m, OPGRAD_ERR_IO, "%s: cannot write checkpoint: %s", path, strerror(saved_errno));
    }
    free(tmp);
    m->error[0] = '\0';
    return OPGRAD_OK;
}
