// Modelina's DEFAULT TypeScript and Java generators on an AsyncAPI document: no options, no presets
// (what `asyncapi generate models typescript|java` gives an integrator), for tests/contract/test_generic_tools.py.
// Usage: node generate-defaults.mjs <asyncapi.yaml> <out dir>   (writes <out dir>/typescript, <out dir>/java)
// Prints one JSON line: {<language>: {"models": [written type names], "unnamed": [models given no name]}}.
import { readFileSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { TypeScriptFileGenerator, JavaFileGenerator } from '@asyncapi/modelina';
import { Parser } from '@asyncapi/parser';

const [file, outDir] = process.argv.slice(2);
const { document, diagnostics } = await new Parser().parse(readFileSync(file, 'utf8'));
if (!document) {
  for (const d of diagnostics) console.error(`${d.code}: ${d.message} at ${JSON.stringify(d.path)}`);
  process.exit(1);
}
const out = {};
// the file generators need an export style (TypeScript) and a package (Java); nothing else is set
for (const [language, generator, options] of [
  ['typescript', new TypeScriptFileGenerator(), { exportType: 'named' }],
  ['java', new JavaFileGenerator(), { packageName: 'robobus.models' }],
]) {
  const models = await generator.generateCompleteModels(document, options);
  const dir = join(outDir, language);
  mkdirSync(dir, { recursive: true });
  await generator.generateToFiles(document, dir, options);
  out[language] = {
    models: models.map((m) => m.modelName).filter((n) => n).sort(),
    unnamed: models.filter((m) => !m.modelName).map((m) => m.model.name).sort(),
  };
}
console.log(JSON.stringify(out));
