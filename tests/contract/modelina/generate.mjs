// Generate typed models from an AsyncAPI document with the official AsyncAPI model generator
// (Modelina), the way an integrator in another language would. Usage:
//   node generate.mjs <asyncapi.yaml> <typescript|java|go|python> <out dir>
//   node generate.mjs <asyncapi.yaml> typescript,java,go,python <out dir>   (one parse; <out dir>/<language>)
// Writes the model files and prints, as the last line, one JSON object per language:
//   {"language", "models": [written type names], "inlined": [schema names rendered inline],
//    "anonymous": [models without a name]}   (files are written only when none is anonymous)
// or, for several languages, {"languages": {<language>: <that object>}}.
import { readFileSync, mkdirSync } from 'node:fs';
import { join } from 'node:path';
import {
  TypeScriptFileGenerator, JavaFileGenerator, GoFileGenerator, PythonFileGenerator,
  typeScriptDefaultModelNameConstraints,
} from '@asyncapi/modelina';
import { Parser } from '@asyncapi/parser';

const [file, languageArg, outDir] = process.argv.slice(2);
if (!file || !languageArg || !outDir) {
  console.error('usage: node generate.mjs <asyncapi.yaml> <typescript|java|go|python>[,...] <out dir>');
  process.exit(2);
}
const languages = languageArg.split(',');

const parser = new Parser();
const { document, diagnostics } = await parser.parse(readFileSync(file, 'utf8'));
if (!document) {
  for (const d of diagnostics) console.error(`${d.code}: ${d.message} at ${JSON.stringify(d.path)}`);
  process.exit(1);
}

// Modelina (5.10) writes a Double field's default as the JSON number it parsed, so a default of 2.0
// becomes `Double timeoutS = 2;`, which javac rejects (int is not Double). This preset writes it
// as a double literal; every other field is left to Modelina.
const javaNumberDefaults = {
  class: {
    property({ property, content }) {
      const dflt = property.property.originalInput?.default;
      if (['Double', 'Float'].includes(property.property.type) && Number.isInteger(dflt)) {
        const suffix = property.property.type === 'Float' ? 'f' : 'd';
        return `private ${property.property.type} ${property.propertyName} = ${dflt}${suffix};`;
      }
      return content;
    },
  },
};

// Generator options are the ones the README documents for each language.
const setups = {
  typescript: [new TypeScriptFileGenerator({
    // interfaces of the JSON as it is on the wire: `JSON.parse(payload) as EpuckSensors` then holds,
    // with the field names of the document (battery_v, not batteryV) and objects as records
    modelType: 'interface', enumType: 'union', mapType: 'record', rawPropertyNames: true,
    // Modelina checks model names against keywords and browser globals in lower case, before making
    // them PascalCase, so the kit's `Status` would become `ReservedStatus`. Our names are PascalCase
    // (every keyword is lower case) and interfaces are types only: keep the names as they are.
    constraints: { modelName: typeScriptDefaultModelNameConstraints({ NO_RESERVED_KEYWORDS: (v) => v }) },
  }),
    { exportType: 'named' }],
  java: [new JavaFileGenerator({ collectionType: 'List', presets: [javaNumberDefaults] }),
    { packageName: 'robobus.models' }],
  go: [new GoFileGenerator(), { packageName: 'models' }],
  python: [new PythonFileGenerator(), {}],
};
const unknown = languages.filter((l) => !setups[l]);
if (unknown.length) {
  console.error(`unknown language ${unknown.join(', ')}; one of ${Object.keys(setups).join(', ')}`);
  process.exit(2);
}

// Modelina names a schema without a title or a component key "AnonymousSchema_N". A language that
// has no type of its own for a schema (a union of primitives in Java, any union in Python) renders
// it inline and gives the output an empty name; Modelina writes no file for it. The schema itself
// must still have had a name.
async function generate(language, dir) {
  const [generator, options] = setups[language];
  const models = await generator.generateCompleteModels(document, options);
  const anonymous = models.map((m) => m.model.name).filter((n) => !n || /anonymous/i.test(n));
  if (anonymous.length === 0) {
    mkdirSync(dir, { recursive: true });
    await generator.generateToFiles(document, dir, options);
  }
  return {
    language,
    models: models.filter((m) => m.modelName !== '').map((m) => m.modelName).sort(),
    inlined: models.filter((m) => m.modelName === '').map((m) => m.model.name).sort(),
    anonymous,
  };
}

if (languages.length === 1) {
  console.log(JSON.stringify(await generate(languages[0], outDir)));
} else {
  const out = {};
  for (const l of languages) out[l] = await generate(l, join(outDir, l));
  console.log(JSON.stringify({ languages: out }));
}
