// OpenTelemetry for the producer, loaded before it: `node --import ./tracing.js produce.js ...`.
// With OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) set and OTEL_SDK_DISABLED not
// `true` (darkroom's own rule), spans go to that collector
// over OTLP/HTTP protobuf, W3C trace context is the propagator, and produce.js's
// `darkroom.produce` span becomes the parent of darkroom's spans of the photo.
import { BatchSpanProcessor, NodeTracerProvider } from "@opentelemetry/sdk-trace-node";
import { OTLPTraceExporter } from "@opentelemetry/exporter-trace-otlp-proto";
import { defaultResource, detectResources, envDetector } from "@opentelemetry/resources";

const env = process.env;
const endpoint = env.OTEL_EXPORTER_OTLP_ENDPOINT || env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT;
if (endpoint && env.OTEL_SDK_DISABLED?.trim().toLowerCase() !== "true") {
  const provider = new NodeTracerProvider({
    // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the producer
    resource: defaultResource().merge(detectResources({ detectors: [envDetector] })),
    spanProcessors: [new BatchSpanProcessor(new OTLPTraceExporter())],
  });
  provider.register(); // the AsyncLocalStorage context manager and the W3C propagator
  let flushed = false;
  process.on("beforeExit", async () => { // the last spans leave before the process does
    if (flushed) return;
    flushed = true;
    await provider.shutdown();
  });
}
