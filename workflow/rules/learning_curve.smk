# The data-budget planner (plan.learning_curve): the drafter trained again on nested fractions of
# the training samples, and eaglet.learning_curve.learning_curve's fit of τ against the tokens, with predictions,
# their costs on this hardware and the check that the fractions predict the full data.
# Off by default (each fraction is one more training job): the rules exist, the run asks for
# them only with plan.learning_curve: true.
import json

from eaglet.workflow.resolve import thaw

PLAN = config["plan"]
LC_DIR = f"{RUN}/learning_curve"
LC_FRACTIONS = [f"{float(f):g}" for f in PLAN["fractions"]]


use rule train as train_fraction with:
    output:
        drafter=f"{LC_DIR}/f{{frac}}/drafter.safetensors",
        metrics=f"{LC_DIR}/f{{frac}}/metrics.parquet",
        summary=f"{LC_DIR}/f{{frac}}/train_summary.json",
    log:
        f"{LOGS}/learning_curve/train_f{{frac}}.log",
    wildcard_constraints:
        frac=r"0\.[0-9]+",
    params:
        # train's, with this fraction's settings file and data_fraction among the keys
        **(
            TRAIN_PARAMS
            | {
                "data_fraction": lambda wildcards: f"data_fraction={wildcards.frac}",
                "train": lambda wildcards, output: json.dumps(
                    thaw(R.train) | {"data_fraction": float(wildcards.frac)},
                    sort_keys=True,
                ),
            }
        ),


rule learning_curve:
    input:
        **(
            {"generate": rules.generate.output.summary}
            if config["generate"]["enabled"]
            else {}
        ),
        **(
            {}
            if R.storage.online
            else {
                "hidden": expand(
                    f"{RUN}/extract/shard_{{shard}}",
                    shard=R.extract_shards,
                )
            }
        ),
        code=stage_code("learning_curve.learning_curve"),
        full=rules.train.output.summary,
        fractions=expand(f"{LC_DIR}/f{{frac}}/train_summary.json", frac=LC_FRACTIONS),
        # the stored states' disk (none online: the target runs inside each training)
    output:
        curve=report(
            f"{LC_DIR}/learning_curve.json",
            caption="../report/learning_curve.rst",
            category="3. Drafter",
            labels={"artifact": "learning curve"},
        ),
    log:
        f"{LOGS}/learning_curve.log",
    conda:
        "../../envs/eaglet.yaml"
    params:
        **key_params("plan", PLAN, ["multipliers", "confidence", "require_check"]),
        generate=lambda wildcards, input: (
            f"--generate {input.generate}" if "generate" in input.keys() else ""
        ),
        index=lambda wildcards, input: [
            f"{h}/index.json"
            for h in (input.hidden if "hidden" in input.keys() else [])
        ],
        run_dir=lambda wildcards, input: str(Path(input.full).parents[1]),
        opts=settings(
            {k: PLAN[k] for k in ("multipliers", "confidence", "require_check")}
        ),
    shell:
        "python -m eaglet.learning_curve.learning_curve --full {input.full:q} --fractions {input.fractions:q}"
        " {params.generate} --hidden {params.index:q} --run-dir {params.run_dir:q} --out {output.curve:q}"
        " --config {params.opts:q} --log {log:q}"


if PLAN["learning_curve"]:
    FINAL_OUTPUTS.append(rules.learning_curve.output.curve)
