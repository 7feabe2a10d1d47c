/* The AMX tile operations of the tile path (qmatmul_amx.c), with two definitions behind one set of
 * names, as isa.h selects (VS_AMX):
 *
 *   real (VS_AMX_REAL, the "amx" variant, built with -mamx-tile -mamx-int8): the intrinsics
 *     _tile_loadconfig, _tile_zero, _tile_loadd, _tile_dpbssd, _tile_stored, _tile_release; tile
 *     data must first be granted to the process by the kernel (amx_request_tiles, Linux
 *     arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), which qmm_tiles_init asks once;
 *   emulated (VS_AMX_EMULATED, the test build "amx-emulated": -DBLOCKMM_EMULATE_AMX with the AVX2
 *     flags and the emulated VNNI's 16-lane vectors): eight tile registers per thread in portable C,
 *     configured, loaded, multiplied and stored as the instructions define it, so the path's logic
 *     (layouts, tile shapes, strides, the signed products) is tested bit for bit on any x86 CPU.
 *
 * tile_dpbssd(c, a, b) (TDPBSSD): for every row m < rows(c) and int32 column n < colsb(c) / 4,
 *   c[m][n] += sum over k < colsb(a) / 4 and i < 4 of (int8) a[m][4k + i] * (int8) b[k][4n + i]
 * (exact int32 sums). A tile holds up to 16 rows of up to 64 bytes; amx_config gives each tile its
 * rows and bytes per row (palette 1). Tile numbers must be compile-time constants (the real
 * instructions encode them). */
#ifndef VERISPEC_AMX_H
#define VERISPEC_AMX_H
#include <stdint.h>
#include <string.h>
#include "isa.h"

#ifdef VS_AMX
#define AMX_MAX_ROWS 16  /* rows per tile */
#define AMX_MAX_BYTES 64 /* bytes per tile row */

/* The 64-byte tile configuration (_tile_loadconfig's operand), palette 1. */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* Tile t: `rows` rows of `colsb` bytes. */
static inline void amx_config_tile(AmxConfig *config, int t, int rows, int colsb) {
    config->palette_id = 1;
    config->rows[t] = (uint8_t)rows;
    config->colsb[t] = (uint16_t)colsb;
}

#ifdef VS_AMX_REAL
#include <sys/syscall.h>
#include <unistd.h>
#define VS_ARCH_REQ_XCOMP_PERM 0x1023
#define VS_XFEATURE_XTILEDATA 18
/* 0 where the kernel grants this process the tile data state (Linux 5.16 and later), else -1. */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, VS_ARCH_REQ_XCOMP_PERM, VS_XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}
#define amx_load_config(config) _tile_loadconfig(config)
#define amx_release() _tile_release()
#define tile_zero(t) _tile_zero(t)
#define tile_load(t, base, stride) _tile_loadd(t, base, stride)
#define tile_store(t, base, stride) _tile_stored(t, base, stride)
#define tile_dpbssd(c, a, b) _tile_dpbssd(c, a, b)
#else /* VS_AMX_EMULATED */
typedef struct {
    int rows, colsb;
    uint8_t data[AMX_MAX_ROWS][AMX_MAX_BYTES];
} EmuTile;
static _Thread_local EmuTile emu_tiles[8]; /* a thread's tile registers, as the real ones are */

static inline void emu_load_config(const AmxConfig *config) {
    for (int t = 0; t < 8; t++) {
        emu_tiles[t].rows = config->rows[t];
        emu_tiles[t].colsb = config->colsb[t];
        memset(emu_tiles[t].data, 0, sizeof emu_tiles[t].data);
    }
}

static inline void emu_release(void) {
    for (int t = 0; t < 8; t++) emu_tiles[t].rows = emu_tiles[t].colsb = 0;
}

static inline void emu_zero(int t) { memset(emu_tiles[t].data, 0, sizeof emu_tiles[t].data); }

/* Rows of colsb bytes from base, stride bytes apart; the rest of the tile zeroed (as TILELOADD). */
static inline void emu_load(int t, const void *base, int64_t stride) {
    EmuTile *tile = &emu_tiles[t];
    emu_zero(t);
    for (int r = 0; r < tile->rows; r++) memcpy(tile->data[r], (const uint8_t *)base + r * stride, (size_t)tile->colsb);
}

static inline void emu_store(int t, void *base, int64_t stride) {
    const EmuTile *tile = &emu_tiles[t];
    for (int r = 0; r < tile->rows; r++) memcpy((uint8_t *)base + r * stride, tile->data[r], (size_t)tile->colsb);
}

static inline void emu_dpbssd(int c, int a, int b) {
    EmuTile *C = &emu_tiles[c];
    const EmuTile *A = &emu_tiles[a], *B = &emu_tiles[b];
    for (int m = 0; m < C->rows; m++)
        for (int n = 0; n < C->colsb / 4; n++) {
            uint32_t sum; /* int32 arithmetic, wrapping as the instruction's */
            memcpy(&sum, C->data[m] + 4 * n, 4);
            for (int k = 0; k < A->colsb / 4; k++)
                for (int i = 0; i < 4; i++)
                    sum += (uint32_t)((int32_t)(int8_t)A->data[m][4 * k + i] * (int32_t)(int8_t)B->data[k][4 * n + i]);
            memcpy(C->data[m] + 4 * n, &sum, 4);
        }
}
#define amx_load_config(config) emu_load_config(config)
#define amx_release() emu_release()
#define tile_zero(t) emu_zero(t)
#define tile_load(t, base, stride) emu_load(t, base, stride)
#define tile_store(t, base, stride) emu_store(t, base, stride)
#define tile_dpbssd(c, a, b) emu_dpbssd(c, a, b)
#endif
#endif
#endif
