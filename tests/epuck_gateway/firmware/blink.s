/* A minimal Cortex-M4 firmware for the flash tests: vector table, a loop, 16 KiB of constants, and
   an initialised .data whose load address is in flash (so the load has three sections). */
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
    .rept 4096
    .word 0x12345678
    .endr
    .data
value:
    .word 0xCAFEBABE
