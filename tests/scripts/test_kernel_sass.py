"""scripts/kernel_sass.py reads cuobjdump's SASS text: the main loop is the longest backward branch holding a matrix
multiply, counted by class; the program's length counts every instruction once."""

from __future__ import annotations

from scripts.kernel_sass import describe, loop_profile, pdl_problem, program_length

# cuobjdump -sass's shape: an address comment, an optional predicate, the opcode and operands, the encoding.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;                 /* 0x0000000404027981 */
        /*0020*/                   IADD3 R3, R3, 0x1, RZ ;                      /* 0x0000000103037810 */
        /*0030*/                   IADD3 R4, R4, 0x4, RZ ;                      /* 0x0000000404047810 */
        /*0040*/                   ISETP.GE.AND P0, PT, R3, R9, PT ;            /* 0x000000090300720c */
        /*0050*/              @!P0 BRA 0x10 ;                                   /* 0xfffffffc00008947 */
        /*0060*/                   LOP3.LUT R5, R2, 0x81c081c0, RZ, 0xc0, !PT ; /* 0x81c081c002057812 */
        /*0070*/                   HMUL2.BF16_V2 R6, R5, R7.H0_H0 ;             /* 0x2000000705067232 */
        /*0080*/                   HGMMA.64x16x16.F32.BF16 R8, gdesc[UR4], R8 ; /* 0x0000000004087a3a */
        /*0090*/              @!P1 BRA 0x60 ;                                   /* 0xfffffffc00008947 */
        /*00a0*/                   EXIT ;                                       /* 0x000000000000794d */
"""


def test_the_main_loop_is_the_one_with_the_matrix_multiply():
    """The loop 0x60..0x90 holds the HGMMA; the longer loop 0x10..0x50 is only loads and address arithmetic."""
    body = loop_profile(SASS)
    assert body == {"LOP3.LUT": 1, "HMUL2.BF16_V2": 1, "HGMMA.64x16x16.F32.BF16": 1, "BRA": 1}
    line = describe(body, weight_bytes_per_thread=2.0)
    assert line.startswith("4 instr/iter = 2.00/B") and "int 0.50/B [LOP3.LUT 0.50]" in line


def test_the_program_length_counts_each_instruction_once():
    assert program_length(SASS) == 11


def test_pdl_problem_flags_memory_touched_before_the_wait():
    """A kernel compiled for programmatic dependent launch may compute indices, read its parameters and prefetch into
    L2 before `griddepcontrol.wait`; a load, a store or an atomic there races with the kernel before it."""
    wait = "\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n\tld.global.b32 %r9, [%rd3];\n"
    safe = "\tld.param.u64 %rd1, [k_param_0];\n\tmov.u32 %r1, %ctaid.x;\n\tprefetch.global.L2 [%rd2]; mov.u32 %r2, 0;\n"
    assert pdl_problem(safe + wait) == ""
    for early in ("\tld.global.v4.b32 {%r3, %r4, %r5, %r6}, [%rd2];\n", "\t@%p1 st.global.b16 [%rd4], %rs1;\n",
                  "\t@!%p2 ld.global.nc.b32 %r7, [%rd2];\n", "\tatom.global.acq_rel.gpu.add.u32 %r8, [%rd2], 1;\n",
                  "\tcp.async.cg.shared.global [%r1], [%rd2], 16;\n", "\tst.shared.b32 [%r1], %r2;\n"):
        assert "before its griddepcontrol.wait" in pdl_problem(safe + early + wait), early
    assert pdl_problem(safe).startswith("no griddepcontrol.wait")
