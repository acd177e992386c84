/* A minimal Cortex-M4 firmware for the flash tests: vector table, a loop, BLOB_WORDS words of constants
   (16 KiB unless `as --defsym BLOB_WORDS=n` says otherwise), an initialised .data whose load address is
   in flash (so the load has three sections) and a .bss (in RAM, never written to flash). */
    .syntax unified
    .cpu cortex-m4
    .thumb
    .section .isr_vector, "a"
    .word 0x20020000
    .word reset
    .text
    .thumb_func
    .global reset
reset:
    ldr r0, =value
    ldr r1, [r0]
1:  b 1b
    .section .rodata
    .align 2
blob:
    .ifndef BLOB_WORDS
    .set BLOB_WORDS, 4096
    .endif
    .rept BLOB_WORDS
    .word 0x12345678
    .endr
    .data
value:
    .word 0xCAFEBABE
    .bss
    .align 2
buffer:
    .space 1024
