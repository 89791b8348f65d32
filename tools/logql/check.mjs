#!/usr/bin/env node
// Syntax-check LogQL with Grafana's own grammar (@grafana/lezer-logql, the parser behind Grafana's
// Loki query editor). Loki itself cannot run where the tests run; this is the check that can.
//
//   echo '["{job=\"x\"} |= \"error\""]' | node check.mjs
//
// Reads a JSON array of expressions on stdin; writes a JSON array of {expr, ok, errors}; exits 1 when
// any expression has a syntax error (an error node in the parse tree, or a tree that is not a query).
import { parser } from "@grafana/lezer-logql";

function check(expr) {
  const tree = parser.parse(expr);
  const errors = [];
  tree.iterate({
    enter(node) {
      if (node.type.isError) {
        errors.push({ from: node.from, to: node.to, near: expr.slice(Math.max(0, node.from - 15), node.to + 15) });
      }
    },
  });
  const top = tree.topNode.firstChild;
  if (!errors.length && (!top || top.name !== "Expr")) {
    errors.push({ from: 0, to: expr.length, near: "not a LogQL query" });
  }
  return { expr, ok: errors.length === 0, errors };
}

let input = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => { input += chunk; });
process.stdin.on("end", () => {
  let exprs;
  try {
    exprs = JSON.parse(input);
    if (!Array.isArray(exprs) || !exprs.every((e) => typeof e === "string")) throw new Error("not an array of strings");
  } catch (err) {
    process.stderr.write(`logql-check: stdin must be a JSON array of strings: ${err.message}\n`);
    process.exit(2);
  }
  const results = exprs.map(check);
  process.stdout.write(JSON.stringify(results, null, 1) + "\n");
  process.exit(results.every((r) => r.ok) ? 0 : 1);
});
