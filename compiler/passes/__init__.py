"""Compiler passes: one small class per module, run in the order compiler/pipeline.py lists.

    base.py         CompilePass, PassResult, CompileError / PassError
    context.py      CompileContext (registry, capability table, config, programs, results), CompileConfig
    manager.py      PassManager: runs the list over every program, instruments around each pass
    instruments.py  TimingInstrument, DumpInstrument
    annotate.py     AnnotateOpsPass: op, layer id, registry kind and module of each hgc op node
    shared_expert.py  SharedExpertPass (--overlap): each moe op's shared expert taken out into graph glue
    routing.py      RoutingPass: each op node to a backend, from the registry and the capability table
    split.py        SplitPass: per mode, an order-preserving plan of captured pieces and eager gaps
    overlap.py      OverlapPass (--overlap): side-stream branches of each captured piece (networkx), with fork and join
    lints.py        LintPass: runs a group of rules from compiler/lints/
"""
