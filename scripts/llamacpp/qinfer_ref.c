// qinfer_ref.c - tiny reference dumper linked against llama.cpp's libllama.
//
// Used only by scripts/llamacpp_reference.sh to produce the golden fixtures in
// tests/fixtures/smollm2/. Not built by cargo or CI.
//
// Usage:
//   qinfer_ref -m MODEL [-t THREADS] [-c N_CTX] [-fa on|off|auto] [-kv f16|f32] MODE ...
//
// Context defaults are llama_context_default_params() (flash attention auto = on for
// CPU, f16 KV cache) plus n_ctx = n_batch = n_ubatch = N_CTX (default 512). With a
// dequantized all-F32 GGUF, "-fa off -kv f32" gives exact float32 math.
//
// Modes:
//   tokenize TEXT            tokenize TEXT (no BOS added, special tokens parsed)
//                            and print the ids as a JSON array on stdout.
//   detok IDS                write the raw bytes of llama_detokenize(IDS) to stdout
//                            (special tokens rendered as text, no cleanup).
//   greedy IDS N             IDS is a comma-separated list of prompt token ids.
//                            Decodes the prompt in one batch, then generates N tokens
//                            one at a time by argmax over the last logits row
//                            (ties -> lowest id). EOS/EOG is NOT a stop condition.
//                            Prints one JSON object on stdout:
//                            {"new_ids":[...], "margins":[...], "first_eog":k|-1}
//                            where margins[i] = top1 - top2 logit at step i.
//   logits IDS OUT.npy       teacher-forced: decodes IDS in one batch with logits
//                            requested for every position and writes them as a
//                            little-endian float32 .npy array [n_tokens, n_vocab].
//                            Prints {"n_tokens":..,"n_vocab":..,"argmax":[...]}.
//
// Only the plain C API of llama.h is used (llama_batch_init / llama_decode /
// llama_get_logits_ith), which has been stable across many llama.cpp versions.

#include "llama.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *msg) {
    fprintf(stderr, "qinfer_ref: %s\n", msg);
    exit(1);
}

static int parse_ids(const char *s, llama_token **out) {
    int cap = 16, n = 0;
    llama_token *ids = malloc(sizeof(llama_token) * cap);
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) die("bad id list");
        if (n == cap) {
            cap *= 2;
            ids = realloc(ids, sizeof(llama_token) * cap);
        }
        ids[n++] = (llama_token) v;
        p = end;
        while (*p == ',' || *p == ' ') p++;
    }
    *out = ids;
    return n;
}

static void argmax2(const float *row, int n_vocab, int *best, float *margin) {
    int b = 0;
    float v1 = row[0], v2 = -INFINITY;
    for (int i = 1; i < n_vocab; i++) {
        if (row[i] > v1) {
            v2 = v1;
            v1 = row[i];
            b = i;
        } else if (row[i] > v2) {
            v2 = row[i];
        }
    }
    *best = b;
    *margin = v1 - v2;
}

static void write_npy_f32(const char *path, const float *data, int rows, int cols) {
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot open npy output");
    char header[256];
    int hl = snprintf(header, sizeof(header),
                      "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }", rows, cols);
    // total header (magic 6 + version 2 + len 2 + header + pad + '\n') multiple of 64
    int total = 10 + hl + 1;
    int pad = (64 - total % 64) % 64;
    for (int i = 0; i < pad; i++) header[hl++] = ' ';
    header[hl++] = '\n';
    const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    fwrite(magic, 1, 8, f);
    uint16_t hlen = (uint16_t) hl;  // x86-64: little endian
    fwrite(&hlen, 2, 1, f);
    fwrite(header, 1, hl, f);
    fwrite(data, sizeof(float), (size_t) rows * cols, f);
    fclose(f);
}

int main(int argc, char **argv) {
    const char *model_path = NULL;
    int n_threads = 2;
    int n_ctx = 512;
    int fa = -2;  // -2: llama_context_default_params() (auto), else -1 auto, 0 off, 1 on
    int kv_f32 = 0;
    int no_repack = 0;
    int n_ubatch = 0;  // 0: = n_ctx
    int i = 1;
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc) model_path = argv[++i];
        else if (!strcmp(argv[i], "-t") && i + 1 < argc) n_threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-c") && i + 1 < argc) n_ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-fa") && i + 1 < argc) {
            const char *v = argv[++i];
            fa = !strcmp(v, "on") ? 1 : !strcmp(v, "off") ? 0 : -1;
        } else if (!strcmp(argv[i], "-kv") && i + 1 < argc) kv_f32 = !strcmp(argv[++i], "f32");
        else if (!strcmp(argv[i], "-norepack")) no_repack = 1;
        else if (!strcmp(argv[i], "-ub") && i + 1 < argc) n_ubatch = atoi(argv[++i]);
        else break;
    }
    if (!model_path || i >= argc) die("usage: qinfer_ref -m MODEL [-t N] [-c N] [-fa on|off|auto] [-kv f16|f32] [-norepack] [-ub N] (tokenize|detok|greedy|logits) ...");
    const char *mode = argv[i++];

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    if (no_repack) mp.use_extra_bufts = false;  // no CPU weight repacking: plain ggml_vec_dot kernels
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (!model) die("failed to load model");
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    if (!strcmp(mode, "tokenize")) {
        if (i >= argc) die("tokenize needs TEXT");
        const char *text = argv[i];
        int len = (int) strlen(text);
        int cap = len + 8;
        llama_token *ids = malloc(sizeof(llama_token) * cap);
        int n = llama_tokenize(vocab, text, len, ids, cap, /*add_special*/ false, /*parse_special*/ true);
        if (n < 0) die("tokenize failed");
        printf("[");
        for (int k = 0; k < n; k++) printf(k ? ",%d" : "%d", ids[k]);
        printf("]\n");
        llama_model_free(model);
        return 0;
    }

    if (!strcmp(mode, "detok")) {
        if (i >= argc) die("detok needs IDS");
        llama_token *ids;
        int n = parse_ids(argv[i], &ids);
        int cap = 64 + 256 * n;
        char *buf = malloc(cap);
        int len = llama_detokenize(vocab, ids, n, buf, cap, /*remove_special*/ false, /*unparse_special*/ true);
        if (len < 0) die("detokenize failed");
        fwrite(buf, 1, len, stdout);
        llama_model_free(model);
        return 0;
    }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;
    cp.n_ubatch = n_ubatch > 0 ? n_ubatch : n_ctx;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.no_perf = true;
    if (fa != -2) cp.flash_attn_type = (enum llama_flash_attn_type) fa;
    if (kv_f32) {
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
    }
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) die("failed to create context");

    if (!strcmp(mode, "greedy")) {
        if (i + 1 >= argc) die("greedy needs IDS N");
        llama_token *prompt;
        int n_prompt = parse_ids(argv[i], &prompt);
        int n_gen = atoi(argv[i + 1]);
        if (n_prompt + n_gen > n_ctx) die("n_ctx too small");

        struct llama_batch batch = llama_batch_init(n_ctx, 0, 1);
        batch.n_tokens = n_prompt;
        for (int k = 0; k < n_prompt; k++) {
            batch.token[k] = prompt[k];
            batch.pos[k] = k;
            batch.n_seq_id[k] = 1;
            batch.seq_id[k][0] = 0;
            batch.logits[k] = (k == n_prompt - 1);
        }
        int first_eog = -1;
        printf("{\"new_ids\":[");
        float *margins = malloc(sizeof(float) * (n_gen > 0 ? n_gen : 1));
        int pos = n_prompt;
        for (int step = 0; step < n_gen; step++) {
            if (llama_decode(ctx, batch) != 0) die("decode failed");
            const float *row = llama_get_logits_ith(ctx, batch.n_tokens - 1);
            int best;
            argmax2(row, n_vocab, &best, &margins[step]);
            if (first_eog < 0 && llama_vocab_is_eog(vocab, best)) first_eog = step;
            printf(step ? ",%d" : "%d", best);
            batch.n_tokens = 1;
            batch.token[0] = best;
            batch.pos[0] = pos++;
            batch.n_seq_id[0] = 1;
            batch.seq_id[0][0] = 0;
            batch.logits[0] = 1;
        }
        printf("],\"margins\":[");
        for (int step = 0; step < n_gen; step++) printf(step ? ",%.6f" : "%.6f", margins[step]);
        printf("],\"first_eog\":%d}\n", first_eog);
        llama_batch_free(batch);
    } else if (!strcmp(mode, "logits")) {
        if (i + 1 >= argc) die("logits needs IDS OUT.npy");
        llama_token *ids;
        int n = parse_ids(argv[i], &ids);
        if (n > n_ctx) die("n_ctx too small");
        struct llama_batch batch = llama_batch_init(n, 0, 1);
        batch.n_tokens = n;
        for (int k = 0; k < n; k++) {
            batch.token[k] = ids[k];
            batch.pos[k] = k;
            batch.n_seq_id[k] = 1;
            batch.seq_id[k][0] = 0;
            batch.logits[k] = 1;
        }
        if (llama_decode(ctx, batch) != 0) die("decode failed");
        float *all = malloc(sizeof(float) * (size_t) n * n_vocab);
        printf("{\"n_tokens\":%d,\"n_vocab\":%d,\"argmax\":[", n, n_vocab);
        for (int k = 0; k < n; k++) {
            const float *row = llama_get_logits_ith(ctx, k);
            memcpy(all + (size_t) k * n_vocab, row, sizeof(float) * n_vocab);
            int best;
            float m;
            argmax2(row, n_vocab, &best, &m);
            printf(k ? ",%d" : "%d", best);
        }
        printf("]}\n");
        write_npy_f32(argv[i + 1], all, n, n_vocab);
        llama_batch_free(batch);
    } else {
        die("unknown mode");
    }

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
